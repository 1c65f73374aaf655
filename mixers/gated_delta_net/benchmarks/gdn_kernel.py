"""The chunked gated delta rule alone: blockzoo's Triton kernels (`triton_delta_rule`) against flash-linear-attention's
`chunk_gated_delta_rule` and the torch chunked path, forward and forward+backward, bf16 inputs, packed documents;
and the accuracy of ours and fla's against the float64 torch chunked form (relative errors of the output, the final
states and every input's gradient). Run on a GPU:

    python mixers/gated_delta_net/benchmarks/gdn_kernel.py [--documents 4 --length 4096 --heads 16 --key-heads 16 ...]

`--launches state=4x1,chunk=4x3,value_block=16 ...` times our forward and forward+backward again under other launch
options (KERNEL=WARPSxSTAGES for the kernels' groups prepare, chunk, state, gradient and wy; value_block and
key_block: the value and key channels of a program, chunk_value_block the per-chunk kernels' value channels a block,
min_block the fewest channels a per-chunk block takes; intermediates=fp32|bf16: what the kernels keep between them);
`--profile` prints where each contender's forward+backward spends its GPU time, by kernel.

fla's forward+backward is timed with its Hopper refusal lifted (`gdn_layer.fla_check_lifted`: a figure of its speed
only; its issue #640 says its gradients are wrong there).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from blockzoo.layers.base import Batch
from blockzoo_gated_delta_net.delta_rule import chunked_gated_delta_rule, fla_available, fla_backward_refused

sys.path.insert(0, str(Path(__file__).parent))
from gdn_layer import fla_check_lifted, measure


def inputs(documents, length, key_heads, heads, key_size, value_size, device, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = documents * length

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    q = torch.nn.functional.normalize(randn(tokens, key_heads, key_size), dim=-1) * key_size**-0.5
    k = torch.nn.functional.normalize(randn(tokens, key_heads, key_size), dim=-1)
    v = randn(tokens, heads, value_size)
    g = -torch.nn.functional.softplus(randn(tokens, heads)) * 0.2  # log decays as the layer makes them (< 0)
    beta = torch.sigmoid(randn(tokens, heads))
    initial = randn(documents, heads, key_size, value_size) * 0.1
    return q, k, v, g, beta, initial


def ours(q, k, v, g, beta, initial, cu_seqlens):
    from blockzoo_gated_delta_net.triton_delta_rule import triton_gated_delta_rule

    return triton_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial)


def fla(q, k, v, g, beta, initial, cu_seqlens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    output, final = chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        scale=1.0, initial_state=initial, output_final_state=True, cu_seqlens=cu_seqlens.long(),
    )  # fmt: skip
    return output[0], final


def torch_path(q, k, v, g, beta, initial, cu_seqlens, dtype=torch.float32):
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    batch = Batch(lengths, device=q.device)
    repeat = v.shape[1] // k.shape[1]
    q, k = (x.to(dtype).repeat_interleave(repeat, dim=1) for x in (q, k))
    output, final = chunked_gated_delta_rule(
        q, k, v.to(dtype), g.to(dtype), beta.to(dtype), batch, chunk_size=64, initial=initial.to(dtype)
    )
    return output.to(v.dtype), final


# --launches' kernel groups: the option dictionaries of `triton_delta_rule` they set.
LAUNCH_GROUPS = {
    "prepare": "PREPARE_OPTIONS",
    "chunk": "CHUNK_OPTIONS",
    "state": "STATE_PASS_OPTIONS",
    "gradient": "CHUNK_GRADIENT_OPTIONS",
    "wy": "WY_GRADIENT_OPTIONS",
}
# --launches' block sizes: the attributes of `triton_delta_rule` they set.
BLOCK_SIZES = {
    "value_block": "VALUE_BLOCK", "chunk_value_block": "CHUNK_VALUE_BLOCK", "key_block": "KEY_BLOCK",
    "min_block": "MIN_BLOCK",
}  # fmt: skip


def launch_settings(text: str) -> dict:
    """{attribute of triton_delta_rule: value} of one --launches word."""
    settings = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        try:
            if key in BLOCK_SIZES:
                settings[BLOCK_SIZES[key]] = int(value)
            elif key == "intermediates":
                dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
                if value not in dtypes:
                    raise ValueError(f"intermediates {value!r}: fp32 or bf16")
                settings["INTERMEDIATE_DTYPE"] = dtypes[value]
            elif key in LAUNCH_GROUPS:
                warps, _, stages = value.partition("x")
                settings[LAUNCH_GROUPS[key]] = {"num_warps": int(warps), "num_stages": int(stages)}
            else:
                groups = ", ".join([*LAUNCH_GROUPS, *BLOCK_SIZES, "intermediates"])
                raise ValueError(f"no kernel group {key!r} (groups: {groups})")
        except ValueError as error:
            raise SystemExit(
                f"--launches {text}: {error}; the form is "
                "GROUP=WARPSxSTAGES,value_block=N,chunk_value_block=N,key_block=N,min_block=N,intermediates=fp32|bf16"
            ) from None
    return settings


@contextlib.contextmanager
def launches(settings: dict):
    """Our kernels launched with `settings` (launch_settings) inside the block."""
    import blockzoo_gated_delta_net.triton_delta_rule as module

    saved = {name: getattr(module, name) for name in settings}
    for name, value in settings.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def print_profile(name: str, step, calls: int = 3) -> None:
    """The GPU time of `calls` calls of `step` by kernel, most first."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    table = profiler.key_averages().table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=70)
    print(f"profile {name} ({calls} forward+backward calls):\n{table}", flush=True)


def gradients(function, leaves, cu_seqlens, weights):
    for leaf in leaves:
        leaf.grad = None
    output, final = function(*leaves, cu_seqlens)
    ((output.double() * weights[0]).sum() + (final.double() * weights[1]).sum()).backward()
    return [output.detach(), final.detach()] + [leaf.grad for leaf in leaves]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--key-heads", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--key-size", type=int, default=128)
    parser.add_argument("--value-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true", help="skip the torch path's timing")
    parser.add_argument("--launches", nargs="*", default=[], help="other launch options of ours to time")
    parser.add_argument("--profile", action="store_true", help="print each contender's GPU time by kernel")
    arguments = parser.parse_args()
    other_launches = {f"ours, launches {text}": launch_settings(text) for text in arguments.launches}
    device = torch.device("cuda")
    shape = (arguments.documents, arguments.length, arguments.key_heads, arguments.heads)
    sizes = (arguments.key_size, arguments.value_size)
    base = inputs(*shape, *sizes, device)
    cu_seqlens = torch.arange(arguments.documents + 1, device=device, dtype=torch.int32) * arguments.length
    names = ["output", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial"]

    # Accuracy: bf16 q, k, v, beta (g and the initial state fp32) against float64 on the same rounded inputs.
    rounded = [x.bfloat16() if i in (0, 1, 2, 4) else x for i, x in enumerate(base)]
    generator = torch.Generator(device=device).manual_seed(1)
    tokens = arguments.documents * arguments.length
    weights = (
        torch.randn(
            tokens, arguments.heads, arguments.value_size, generator=generator, device=device, dtype=torch.float64
        ),
        torch.randn(
            arguments.documents, arguments.heads, *sizes, generator=generator, device=device, dtype=torch.float64
        ),
    )
    reference = gradients(
        lambda *a: torch_path(*a, dtype=torch.float64),
        [x.double().requires_grad_() for x in rounded],
        cu_seqlens,
        weights,
    )
    contenders = {"ours": ours}
    if fla_available():
        contenders["fla"] = fla
    # Every contender and every other launch of ours: its accuracy, then its times.
    measured = [(name, function, {}) for name, function in contenders.items()]
    measured += [(name, ours, settings) for name, settings in other_launches.items()]
    for name, function, settings in measured:
        try:
            with launches(settings), fla_check_lifted(name == "fla" and fla_backward_refused()):
                got = gradients(function, [x.clone().requires_grad_() for x in rounded], cu_seqlens, weights)
        except (OutOfResources, RuntimeError) as error:  # a launch that does not fit this GPU: timed as failed below
            print(f"accuracy {name}: failed, {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        errors = {n: float((a.double() - b).norm() / b.norm()) for n, a, b in zip(names, got, reference)}
        print(f"accuracy {name}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()), flush=True)

    timed = measured + ([("torch", torch_path, {})] if not arguments.no_torch else [])
    for name, function, settings in timed:
        leaves = [x.clone().requires_grad_() for x in rounded]

        def step(function=function, leaves=leaves):
            output, final = function(*leaves, cu_seqlens)
            (output.float().sum() + final.sum()).backward()

        try:
            with launches(settings), fla_check_lifted(name == "fla" and fla_backward_refused()):
                with torch.no_grad():
                    forward, _ = measure(
                        lambda function=function, leaves=leaves: function(*leaves, cu_seqlens),
                        arguments.steps,
                        arguments.warmup,
                    )
                both, memory = measure(step, arguments.steps, arguments.warmup)
                if arguments.profile and name != "torch":
                    print_profile(name, step)
        except (OutOfResources, RuntimeError) as error:  # a launch that does not fit this GPU: say so, time the others
            print(f"time {name}: failed, {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        print(
            f"time {name}: forward {forward * 1e3:.2f} ms, forward+backward {both * 1e3:.2f} ms, "
            f"peak {memory / 2**30:.2f} GiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
