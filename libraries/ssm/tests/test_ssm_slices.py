"""blockzoo_ssm over slices of longer sequences, on one process: the scans' initial and final states and the
convolution's preceding inputs against the float64 step-by-step references (values and gradients), then each slice
function run over consecutive slices (micro-sequences, the carry passed along) against the whole sequence in one
call: outputs and the gradients of every input, with documents that straddle slice boundaries, documents shorter
than a slice, one-token documents and slice boundaries on document boundaries. The same functions under
sequence-data parallelism (gloo) are tested in test_ssm_state_passing.py.
"""

import itertools

import pytest
import torch
from test_ssm_numerics import (
    conv_inputs,
    reference_conv,
    reference_selective,
    reference_ssd,
    selective_inputs,
    ssd_inputs,
)

from blockzoo.layers.base import Batch, slice_batch
from blockzoo_ssm import (
    causal_conv1d,
    causal_conv1d_slice,
    selective_scan,
    selective_scan_slice,
    ssd_scan,
    ssd_scan_slice,
)

F64 = torch.float64
LENGTHS = [5, 1, 7, 3]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _first_only(initial: torch.Tensor, documents: int) -> torch.Tensor:
    return torch.cat([initial[None], initial.new_zeros(documents - 1, *initial.shape)])


# ---------------------------------------------------------------------------------------------------------------------
# Initial and final states


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("scale_input", [True, False])
def test_ssd_scan_starts_from_the_initial_state_and_returns_the_final_one(chunk_size, scale_input):
    x, dt, A, B, C = ssd_inputs(LENGTHS)
    initial = torch.randn(*x.shape[1:], B.shape[2], generator=_generator(1), dtype=F64)
    y, final = ssd_scan(
        x, dt, A, B, C, Batch(LENGTHS), chunk_size=chunk_size, scale_input=scale_input, initial_state=initial,
        return_final_state=True,
    )  # fmt: skip
    expected, finals = reference_ssd(
        x, dt, A, B, C, LENGTHS, scale_input=scale_input, initial=_first_only(initial, len(LENGTHS))
    )
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, finals[-1], rtol=1e-12, atol=1e-12)


def test_ssd_scan_initial_and_final_state_gradients():
    lengths = [3, 2]
    x, dt, A, B, C = ssd_inputs(lengths, heads=2, head_size=2, groups=1, state_size=2)
    initial = torch.randn(2, 2, 2, generator=_generator(1), dtype=F64)
    inputs = [t.requires_grad_() for t in (x, dt, A, B, C, initial)]
    batch = Batch(lengths)

    def scan(x, dt, A, B, C, initial):
        return ssd_scan(x, dt, A, B, C, batch, chunk_size=2, initial_state=initial, return_final_state=True)

    assert torch.autograd.gradcheck(scan, inputs, fast_mode=True)


def test_selective_scan_starts_from_the_initial_state_and_returns_the_final_one():
    u, delta, A, B, C = selective_inputs(LENGTHS)
    initial = torch.randn(*A.shape, generator=_generator(1), dtype=F64)
    y, final = selective_scan(u, delta, A, B, C, Batch(LENGTHS), initial_state=initial, return_final_state=True)
    expected, finals = reference_selective(u, delta, A, B, C, LENGTHS, initial=_first_only(initial, len(LENGTHS)))
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, finals[-1], rtol=1e-12, atol=1e-12)


def test_selective_scan_initial_and_final_state_gradients():
    lengths = [3, 2]
    u, delta, A, B, C = selective_inputs(lengths, channels=2, groups=1, state_size=2)
    initial = torch.randn(2, 2, generator=_generator(1), dtype=F64)
    inputs = [t.requires_grad_() for t in (u, delta, A, B, C, initial)]
    batch = Batch(lengths)

    def scan(u, delta, A, B, C, initial):
        return selective_scan(u, delta, A, B, C, batch, initial_state=initial, return_final_state=True)

    assert torch.autograd.gradcheck(scan, inputs)


@pytest.mark.parametrize("kernel_size", [2, 4])
def test_causal_conv1d_reads_the_inputs_before_the_batch(kernel_size):
    x, weight, bias = conv_inputs(LENGTHS, kernel_size=kernel_size)
    initial = torch.randn(kernel_size - 1, x.shape[1], generator=_generator(1), dtype=F64)
    y = causal_conv1d(x, weight, bias, Batch(LENGTHS), activation="silu", initial=initial)
    stored = _first_only(initial.T, len(LENGTHS))  # the reference's per-document [channels, kernel_size - 1]
    expected, _ = reference_conv(x, weight, bias, LENGTHS, activation="silu", initial=stored)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_causal_conv1d_initial_input_gradients():
    lengths = [2, 3]
    x, weight, bias = conv_inputs(lengths, channels=2, kernel_size=3)
    initial = torch.randn(2, 2, generator=_generator(1), dtype=F64)
    inputs = [t.requires_grad_() for t in (x, weight, bias, initial)]
    batch = Batch(lengths)

    def conv(x, weight, bias, initial):
        return causal_conv1d(x, weight, bias, batch, activation="silu", initial=initial)

    assert torch.autograd.gradcheck(conv, inputs)


def test_slice_states_are_checked():
    x, dt, A, B, C = ssd_inputs([3])
    batch = Batch([3], past_lengths=[0])
    state = torch.zeros(1, *x.shape[1:], B.shape[2], dtype=F64)
    with pytest.raises(ValueError, match=r"give `state` .* not both"):
        ssd_scan(x, dt, A, B, C, batch, chunk_size=2, state=state, return_final_state=True)
    with pytest.raises(ValueError, match=r"ssd_scan: initial_state must be \(4, 3, 5\)"):
        ssd_scan(x, dt, A, B, C, batch, chunk_size=2, initial_state=torch.zeros(4, 3))
    u, delta, A, B, C = selective_inputs([3])
    with pytest.raises(ValueError, match=r"selective_scan: initial_state must be \(6, 4\)"):
        selective_scan(u, delta, A, B, C, batch, initial_state=torch.zeros(6))
    x, weight, bias = conv_inputs([3])
    with pytest.raises(ValueError, match=r"initial must be \[kernel_size - 1, channels\] = \(3, 5\)"):
        causal_conv1d(x, weight, bias, batch, initial=torch.zeros(5, 3))
    with pytest.raises(ValueError, match="not both"):
        causal_conv1d(x, weight, bias, batch, initial=torch.zeros(3, 5), state=torch.zeros(1, 5, 3))


# ---------------------------------------------------------------------------------------------------------------------
# Consecutive slices (micro-sequences) against the whole sequence

# (document lengths, slice boundaries): documents across boundaries, shorter than a slice, of one token, a boundary
# on a document boundary (after 6 tokens in the first case), slices of one and two tokens (shorter than the
# convolution's kernel_size - 1 = 3: the halo reaches back over several slices).
SLICINGS = {
    "straddling-and-on-a-boundary": ([5, 1, 7, 3, 4], [6, 11, 15]),
    "one-long-document-short-slices": ([13], [1, 3, 4, 9]),
    "one-token-documents": ([1, 1, 2, 1, 5], [2, 3, 7]),
}


def _slices(lengths, boundaries):
    """(start, stop, Batch) of each slice."""
    cuts = [0, *boundaries, sum(lengths)]
    return [(start, stop, slice_batch(lengths, start, stop)) for start, stop in itertools.pairwise(cuts)]


def _run_slices(function, per_token, constants, lengths, boundaries):
    """Outputs of `function(*token tensors of the slice, *constants, batch, previous) -> (y, carry)` over the slices
    one after the other, concatenated."""
    outputs, previous = [], None
    for start, stop, batch in _slices(lengths, boundaries):
        y, previous = function(*(t[start:stop] for t in per_token), *constants, batch, previous)
        outputs.append(y)
    return torch.cat(outputs), previous


def _gradients(output, leaves, seed=5):
    weights = torch.randn(output.shape, generator=_generator(seed), dtype=output.dtype)
    return torch.autograd.grad((output * weights).sum(), leaves)


@pytest.mark.parametrize("case", SLICINGS)
@pytest.mark.parametrize("scale_input", [True, False])
def test_ssd_scan_over_consecutive_slices_equals_the_whole_sequence(case, scale_input):
    lengths, boundaries = SLICINGS[case]
    x, dt, A, B, C = ssd_inputs(lengths, heads=4, groups=2)
    D = torch.randn(4, generator=_generator(3), dtype=F64)
    dt_bias = torch.randn(4, generator=_generator(4), dtype=F64)
    leaves = [t.requires_grad_() for t in (x, dt, B, C, A, D, *([dt_bias] if scale_input else []))]
    options = {"chunk_size": 4, "scale_input": scale_input, "dt_softplus": scale_input}

    def run(x, dt, B, C, A, D, dt_bias, batch, previous):
        bias = dt_bias if scale_input else None
        return ssd_scan_slice(x, dt, A, B, C, batch, previous, D=D, dt_bias=bias, **options)

    sliced, carry = _run_slices(run, (x, dt, B, C), (A, D, dt_bias), lengths, boundaries)
    whole = ssd_scan(
        x, dt, A, B, C, Batch(lengths), D=D, dt_bias=dt_bias if scale_input else None, return_final_state=True,
        **options,
    )  # fmt: skip
    torch.testing.assert_close(sliced, whole[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(carry, whole[1], rtol=1e-12, atol=1e-12)
    for got, expected in zip(_gradients(sliced, leaves), _gradients(whole[0], leaves)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", SLICINGS)
def test_selective_scan_over_consecutive_slices_equals_the_whole_sequence(case):
    lengths, boundaries = SLICINGS[case]
    u, delta, A, B, C = selective_inputs(lengths)
    leaves = [t.requires_grad_() for t in (u, delta, B, C, A)]

    def run(u, delta, B, C, A, batch, previous):
        return selective_scan_slice(u, delta, A, B, C, batch, previous)

    sliced, carry = _run_slices(run, (u, delta, B, C), (A,), lengths, boundaries)
    whole, final = selective_scan(u, delta, A, B, C, Batch(lengths), return_final_state=True)
    expected, _ = reference_selective(u, delta, A, B, C, lengths)
    torch.testing.assert_close(sliced, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(carry, final, rtol=1e-12, atol=1e-12)
    for got, expected in zip(_gradients(sliced, leaves), _gradients(whole, leaves)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", SLICINGS)
@pytest.mark.parametrize("kernel_size", [1, 2, 4])
def test_causal_conv1d_over_consecutive_slices_equals_the_whole_sequence(case, kernel_size):
    lengths, boundaries = SLICINGS[case]
    x, weight, bias = conv_inputs(lengths, kernel_size=kernel_size)
    leaves = [t.requires_grad_() for t in (x, weight, bias)]

    def run(x, weight, bias, batch, previous):
        return causal_conv1d_slice(x, weight, bias, batch, previous, activation="silu")

    sliced, carry = _run_slices(run, (x,), (weight, bias), lengths, boundaries)
    whole = causal_conv1d(x, weight, bias, Batch(lengths), activation="silu")
    expected, _ = reference_conv(x, weight, bias, lengths, activation="silu")
    torch.testing.assert_close(sliced, expected, rtol=1e-12, atol=1e-12)
    assert carry.shape == (kernel_size - 1, x.shape[1])
    torch.testing.assert_close(carry, x[len(x) - (kernel_size - 1) :])  # the last inputs, of whatever document
    for got, expected in zip(_gradients(sliced, leaves), _gradients(whole, leaves)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scale_input", [True, False])
def test_the_kernel_call_passes_the_initial_state_and_returns_the_final_one(monkeypatch, scale_input):
    """`mamba_chunk_scan` hands the initial state to mamba_chunk_scan_combined as `initial_states` [1, heads,
    head_size, state] and takes its `final_states` back: a stand-in with the kernel's contract (the state enters
    the first document, seq_idx resets it at every other; the final state is the last token's) checks the call."""
    from blockzoo_ssm import kernels

    def combined(x, dt, A, B, C, chunk_size, D, seq_idx, dt_bias, dt_softplus, dt_limit, **states):
        assert set(states) == {"initial_states", "return_final_states"} and states["return_final_states"]
        initial = states["initial_states"]
        assert initial.shape == (1, *x.shape[2:], B.shape[-1]) and initial.dtype == torch.float32
        lengths = torch.unique_consecutive(seq_idx[0], return_counts=True)[1].tolist()
        y, finals = reference_ssd(
            x[0], dt[0], A, B[0], C[0], lengths, initial=_first_only(initial[0], len(lengths))
        )  # it always scales by dt
        if D is not None:
            y = y + D[:, None] * x[0].double()
        return y[None].to(x.dtype), finals[-1][None].float()

    monkeypatch.setattr(kernels, "_chunk_scan_combined", lambda: combined)
    x, dt, A, B, C = ssd_inputs(LENGTHS, dtype=torch.float32)
    D = torch.randn(x.shape[1], generator=_generator(9))
    initial = torch.randn(*x.shape[1:], B.shape[2], generator=_generator(1))
    document_index = Batch(LENGTHS).document_index
    y, final = kernels.mamba_chunk_scan(
        x, dt, A, B, C, document_index, chunk_size=4, D=D, scale_input=scale_input, initial_state=initial,
        return_final_state=True,
    )  # fmt: skip
    expected, finals = reference_ssd(
        x, dt, A, B, C, LENGTHS, scale_input=scale_input, initial=_first_only(initial, len(LENGTHS))
    )
    torch.testing.assert_close(y.double(), expected + D.double()[:, None] * x.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), finals[-1], rtol=1e-5, atol=1e-5)
