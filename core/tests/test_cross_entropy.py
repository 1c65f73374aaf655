"""The fused linear cross-entropy in one process, against `F.cross_entropy(reduction="sum")` in float64 on the
materialized logits: loss, gradients of the hidden states and of the weight; ignored tokens, chunks that do not divide
the tokens, padding rows, bf16, the no-grad path, and the bound on a chunk's logits. The vocabulary-parallel cases are
in test_vocab_parallel.py; a GPU test compares the fused loss with the materialized one at a Llama-1B shape."""

import functools
import time

import pytest
import torch
import torch.nn.functional as F

from blockzoo.layers import cross_entropy
from blockzoo.layers.base import IGNORE_INDEX
from blockzoo.layers.cross_entropy import linear_cross_entropy

TOKENS, HIDDEN, VOCAB = 37, 16, 50
# fp32 against float64: the only differences are fp32 roundings of sums over ~50 terms.
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(seed: int = 0, tokens: int = TOKENS, vocab: int = VOCAB, ignored: int = 5, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    weight = torch.randn(vocab, HIDDEN, generator=generator) * 0.5
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::ignored] = IGNORE_INDEX
    labels[1] = vocab - 1  # the last id, whose row ends the weight
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def _reference(hidden, weight, labels, scale: float = 1.0):
    """(loss, grad_hidden, grad_weight) of `scale` × the summed cross-entropy on float64 materialized logits."""
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(hidden64 @ weight64.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), hidden64.grad, weight64.grad


def _fused(hidden, weight, labels, scale: float = 1.0, **options):
    loss = linear_cross_entropy(hidden, weight, labels, **options)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_tokens", [None, 1, 7, 36, 37, 100])
def test_matches_float64_cross_entropy(chunk_tokens):
    """One chunk, one token per chunk, chunks that do not divide the 37 tokens (7, 36), exactly the tokens, more."""
    hidden, weight, labels = _inputs()
    # A scale like the trainer's 1 / labelled tokens: the backward scales the gradients precomputed in the forward.
    loss, grad_hidden, grad_weight = _fused(hidden, weight, labels, scale=0.37, chunk_tokens=chunk_tokens)
    expected_loss, expected_hidden, expected_weight = _reference(hidden, weight, labels, scale=0.37)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected_loss, **FP32)
    torch.testing.assert_close(grad_hidden.double(), expected_hidden, **FP32)
    torch.testing.assert_close(grad_weight.double(), expected_weight, **FP32)


def test_all_tokens_ignored_give_zero_loss_and_gradients():
    hidden, weight, labels = _inputs()
    labels = torch.full_like(labels, IGNORE_INDEX)
    loss, grad_hidden, grad_weight = _fused(hidden, weight, labels, chunk_tokens=10)
    expected_loss, expected_hidden, expected_weight = _reference(hidden, weight, labels)
    assert float(expected_loss) == 0.0 and float(loss) == 0.0
    assert torch.equal(grad_hidden, torch.zeros_like(grad_hidden)) and not expected_hidden.any()
    assert torch.equal(grad_weight, torch.zeros_like(grad_weight)) and not expected_weight.any()


def test_another_ignore_index():
    hidden, weight, labels = _inputs()
    labels = torch.where(labels == IGNORE_INDEX, -1, labels)
    loss = linear_cross_entropy(hidden, weight, labels, ignore_index=-1, chunk_tokens=8)
    expected = F.cross_entropy(hidden.double() @ weight.double().T, labels, ignore_index=-1, reduction="sum")
    torch.testing.assert_close(loss.detach().double(), expected, **FP32)


def test_rows_beyond_the_vocabulary_are_padding():
    """`vocab_size` 40 of 50 rows: the loss is that of the first 40 rows' logits, the last rows get zero gradient."""
    hidden, weight, labels = _inputs(vocab=50)
    labels = torch.where(labels >= 40, 39, labels)
    loss, grad_hidden, grad_weight = _fused(hidden, weight, labels, vocab_size=40, chunk_tokens=9)
    expected_loss, expected_hidden, expected_weight = _reference(hidden, weight[:40], labels)
    torch.testing.assert_close(loss.double(), expected_loss, **FP32)
    torch.testing.assert_close(grad_hidden.double(), expected_hidden, **FP32)
    torch.testing.assert_close(grad_weight[:40].double(), expected_weight, **FP32)
    assert torch.equal(grad_weight[40:], torch.zeros(10, HIDDEN))


def test_only_the_inputs_that_need_it_get_a_gradient():
    hidden, weight, labels = _inputs()
    _, expected_hidden, expected_weight = _reference(hidden, weight, labels)
    frozen = weight.detach()
    linear_cross_entropy(hidden, frozen, labels, chunk_tokens=8).backward()
    torch.testing.assert_close(hidden.grad.double(), expected_hidden, **FP32)
    constant = hidden.detach()
    linear_cross_entropy(constant, weight, labels, chunk_tokens=8).backward()
    torch.testing.assert_close(weight.grad.double(), expected_weight, **FP32)


def test_no_grad_skips_the_gradient_work(monkeypatch):
    """Under no_grad (and for inputs that need no gradient) the loss is the same and no softmax gradient is made."""
    hidden, weight, labels = _inputs()
    expected = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8).detach()

    def refuse(*args):
        raise AssertionError("the gradient of the logits was computed without a gradient to compute")

    monkeypatch.setattr(cross_entropy, "_PLAIN", (cross_entropy._statistics, refuse, refuse))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    loss = linear_cross_entropy(hidden.detach(), weight.detach(), labels, chunk_tokens=8)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_token_losses():
    hidden, weight, labels = _inputs()
    loss, token_losses = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8, return_token_losses=True)
    expected = F.cross_entropy(hidden.double() @ weight.double().T, labels, ignore_index=IGNORE_INDEX, reduction="none")
    torch.testing.assert_close(token_losses.double(), expected, **FP32)
    assert not token_losses.requires_grad and loss.requires_grad
    torch.testing.assert_close(loss, token_losses.sum(), rtol=0, atol=0)


def test_bf16_inputs():
    """bf16 hidden states with fp32 master weights (cast inside, as the model does). The reference is float64 on the
    same bf16 values. The loss: logits are rounded once to bf16 (relative error ≤ 2⁻⁹ of each logit, here |logit| ≲
    8), averaging out over the tokens: relative 2e-3 on the sum. The gradients: the logits' gradient and the
    product are each rounded to bf16 (2⁻⁹ relative each), the weight's gradient summed in fp32 over chunks: 1e-2 of
    the largest entry."""
    hidden, weight, labels = _inputs(dtype=torch.bfloat16, tokens=64)
    loss, grad_hidden, grad_weight = _fused(hidden, weight, labels, chunk_tokens=24)
    assert grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.float32
    expected_loss, expected_hidden, expected_weight = _reference(hidden, weight.bfloat16(), labels)
    torch.testing.assert_close(loss.double(), expected_loss, rtol=2e-3, atol=0)
    for grad, expected in ((grad_hidden, expected_hidden), (grad_weight, expected_weight)):
        scale = float(expected.abs().max())
        torch.testing.assert_close(grad.double(), expected, rtol=1e-2, atol=1e-2 * scale)


def test_a_chunk_holds_at_most_the_element_budget(monkeypatch):
    """With a budget of 100 logits per chunk and 50 columns: chunks of 2 tokens (37 tokens: 19 chunks, balanced so
    that none is a sliver), and the result unchanged."""
    shapes = []

    def spy(logits, targets, labelled):
        shapes.append(tuple(logits.shape))
        return cross_entropy._loss_and_gradient(logits, targets, labelled)

    monkeypatch.setitem(cross_entropy.CHUNK_ELEMENTS, "cpu", 100)
    monkeypatch.setattr(cross_entropy, "_PLAIN", (cross_entropy._statistics, cross_entropy._softmax_gradient, spy))
    hidden, weight, labels = _inputs()
    loss, grad_hidden, _ = _fused(hidden, weight, labels)
    assert all(rows * columns <= 100 for rows, columns in shapes)
    assert sum(rows for rows, _ in shapes) == TOKENS and len(shapes) == 19
    expected_loss, expected_hidden, _ = _reference(hidden, weight, labels)
    torch.testing.assert_close(loss.double(), expected_loss, **FP32)
    torch.testing.assert_close(grad_hidden.double(), expected_hidden, **FP32)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"labels": torch.full((TOKENS,), VOCAB)}, r"label 50 is outside the vocabulary \[0, 50\)"),
        ({"labels": torch.full((TOKENS,), -3)}, r"label -3 is outside the vocabulary"),
        ({"labels": torch.zeros(TOKENS - 1, dtype=torch.long)}, "do not match"),
        ({"weight": torch.zeros(VOCAB, HIDDEN + 1)}, "do not match"),
        ({"hidden": torch.zeros(TOKENS)}, r"hidden \[tokens, hidden\]"),
        ({"chunk_tokens": 0}, "chunk_tokens must be at least 1"),
    ],
)
def test_bad_inputs_are_refused(change, message):
    hidden, weight, labels = _inputs()
    arguments = {"hidden": hidden, "weight": weight, "labels": labels, **change}
    chunk = arguments.pop("chunk_tokens", None)
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(arguments["hidden"], arguments["weight"], arguments["labels"], chunk_tokens=chunk)


def test_an_unknown_or_unavailable_kernel_is_refused(monkeypatch):
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=r"kernel 'fast' .*; expected one of plain, compiled, triton"):
        linear_cross_entropy(hidden, weight, labels, kernel="fast")
    monkeypatch.setenv(cross_entropy.KERNEL_VARIABLE, "fast")
    with pytest.raises(ValueError, match=f"kernel 'fast' \\(the argument or {cross_entropy.KERNEL_VARIABLE}\\)"):
        linear_cross_entropy(hidden, weight, labels)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"the triton kernel needs CUDA tensors \(or TRITON_INTERPRET=1\)"):
        linear_cross_entropy(hidden, weight, labels, kernel="triton")


# ---------------------------------------------------------------------------------------------------------------------
# GPU: a Llama-1B head (hidden 2048, vocab 128256) over 8192 or 16384 tokens, bf16.


def _materialized(hidden, weight, labels):
    """Today's path: bf16 logits, fp32 for the loss, autograd through both."""
    logits = F.linear(hidden, weight.to(hidden.dtype))
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _measure(function, hidden, weight, labels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int]:
    """(loss, grad hidden, grad weight, seconds per call, peak bytes above the inputs) of forward + backward."""
    for tensor in (hidden, weight):
        tensor.grad = None
    function(hidden, weight, labels).backward()  # warm-up (compilation)
    torch.cuda.synchronize()
    hidden.grad = weight.grad = None
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    start = time.perf_counter()
    repeats = 3
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        loss = function(hidden, weight, labels)
        loss.backward()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    peak = torch.cuda.max_memory_allocated() - baseline
    return loss.detach(), hidden.grad, weight.grad, seconds, peak


@pytest.mark.gpu
def test_gpu_fused_matches_the_materialized_fp32_loss_with_far_less_memory():
    """bf16 compute, fp32 master weight. Against the fp32 materialized reference (the same bf16 inputs, fp32
    products): the loss within 1e-3 (bf16 logits, see test_bf16_inputs), the gradients within 2e-2 of their largest
    entry. Peak memory of forward + backward (above the inputs) well below the materialized bf16 path's (which holds
    [tokens, vocab] logits in bf16 and fp32 and their gradient). Times and peaks are printed (run with -s) for each
    way of computing a chunk's elementwise part (plain, compiled, the Triton kernel)."""
    device = torch.device("cuda")
    tokens, hidden_size, vocab = 16384, 2048, 128256  # 4 chunks of 4096 tokens (at 8192, two: 0.52x)
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=device, generator=generator) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    labels[::97] = IGNORE_INDEX

    def reference(hidden, weight, labels):
        logits = hidden.float() @ weight.to(hidden.dtype).float().T
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")

    expected_loss, expected_hidden, expected_weight, _, _ = _measure(reference, hidden, weight, labels)
    expected_hidden, expected_weight = expected_hidden.clone(), expected_weight.clone()
    *_, materialized_seconds, materialized_peak = _measure(_materialized, hidden, weight, labels)
    results = {}
    for kernel in cross_entropy.KERNELS:
        fused = functools.partial(linear_cross_entropy, kernel=kernel)
        loss, grad_hidden, grad_weight, seconds, peak = _measure(fused, hidden, weight, labels)
        results[kernel] = (seconds, peak)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-3, atol=0)
        for grad, expected in ((grad_hidden, expected_hidden), (grad_weight, expected_weight)):
            scale = float(expected.abs().max())
            torch.testing.assert_close(grad.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)
        assert peak < 0.5 * materialized_peak, (peak, materialized_peak)
    print(
        f"\nhead of {tokens} tokens x {hidden_size} -> {vocab}, forward + backward:"
        f"\n  materialized bf16/fp32: {materialized_seconds * 1e3:.1f} ms, peak {materialized_peak / 2**30:.2f} GiB"
        + "".join(
            f"\n  fused ({kernel}): {seconds * 1e3:.1f} ms, peak {peak / 2**30:.2f} GiB"
            for kernel, (seconds, peak) in results.items()
        )
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_compiled_paths_pointwise_one_hot_is_the_scatter(dtype):
    # The compiled path subtracts the one-hot by comparison (no fp32 rows materialized), the eager one by a scatter.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=generator).to(dtype)
    targets = torch.randint(0, 300, (64,), generator=generator)
    targets[::5] = -1  # not among this rank's columns
    labelled = torch.ones(64, dtype=torch.bool)
    labelled[::7] = False  # ignored: a zero row (its target is -1, as `_chunked` makes it)
    targets[~labelled] = -1
    scattered = cross_entropy._loss_and_gradient(logits, targets, labelled)
    compared = cross_entropy._loss_and_gradient(logits, targets, labelled, pointwise=True)
    for expected, actual in zip(scattered, compared):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert compared[2].dtype == dtype and not compared[2][::7].any()


@pytest.mark.gpu
@pytest.mark.parametrize(("kernel", "new_rows"), [("compiled", 1.25), ("triton", 0.05)])
def test_gpu_chunk_holds_no_fp32_rows(kernel, new_rows):
    """One chunk's loss and gradient (8192 tokens of a 50288 vocabulary, bf16 logits) allocates no fp32 [tokens,
    vocab] buffer (2× the gradient), which the eager scatter's formulation makes the compiler keep: compiled, only
    its bf16 gradient and per-token figures; through the Triton kernel, which writes the gradient over the logits,
    only the per-token figures."""
    device = torch.device("cuda")
    tokens, vocab = 8192, 50288
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, device=device, generator=generator).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    labelled = torch.ones(tokens, dtype=torch.bool, device=device)
    _, _, loss_and_gradient = cross_entropy._elementwise(kernel, device)
    expected = cross_entropy._loss_and_gradient(logits, targets, labelled)
    loss_and_gradient(logits.clone(), targets, labelled)  # compiles
    logits = logits.clone()  # the Triton kernel's gradient overwrites them
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lse, target, gradient = loss_and_gradient(logits, targets, labelled)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    assert peak < new_rows * gradient.numel() * gradient.element_size(), peak / 2**30
    torch.testing.assert_close(lse, expected[0])
    torch.testing.assert_close(target, expected[1])
    torch.testing.assert_close(gradient, expected[2])
