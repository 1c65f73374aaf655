"""Suite `kernels`: the operations of a training step one by one, forward + backward, bf16 activations: ours (the
function blockzoo runs) against torch.compile of the same code, liger-kernel's op where it has one, and torch's own.

    python benchmarks/kernels.py [--cases CASE ...] [--steps 20] [--warmup 3] [--json PATH] [--tiny]

Cases (all by default):
- `rmsnorm-32768x2048`, `rmsnorm-16384x4096` (tokens × hidden): blockzoo's RMSNorm module (fp32 statistics, fp32
  weight); liger `liger_rms_norm`; torch `F.rms_norm`. `add-rmsnorm-…`: the residual add then the norm, as a
  decoder block does; liger `liger_fused_add_rms_norm`.
- `rotary-4096x64`, `rotary-4096x128`, `rotary-8192x64`, `rotary-8192x128` (tokens × head size; 32 query heads, 8
  key-value heads, documents of 4096): blockzoo_attention's `apply_rotary` on queries and keys; liger `liger_rope`
  (given the [batch, heads, tokens, head] views transformers gives it).
- `swiglu-16384x8192` (tokens × ffn): blockzoo's dense MLP gating silu(gate) · up of the gate‖up projection; liger
  `liger_swiglu`.
- `ce-128256`, `ce-50288` (16384 tokens, hidden 2048, vocab 128256 / 50288): the loss summed over the tokens from
  the last hidden states and the fp32 output weight: ours `blockzoo.layers.cross_entropy.linear_cross_entropy`, its
  chunks' elementwise part through its Triton kernel (the default on CUDA) at several launches and compiled
  (`kernel="compiled"`: torch.compile of the plain code, which the kernel must beat);
  materialized logits (bf16) then F.cross_entropy in fp32 (what the model ran before), eager and compiled; liger's
  cross-entropy on the materialized logits and its fused linear cross-entropy.
- `conv-16384`, `conv-32768` (tokens in documents of 4096; 4352 channels = mamba2-1.3b's x‖B‖C, kernel 4, silu):
  ours `blockzoo_ssm.causal_conv1d` reading x‖B‖C from the in_proj output as the mixer does; the same math as plain
  torch (shifted taps, masked at document starts), eager and compiled; cuDNN's depthwise nn.Conv1d over
  [documents, channels, length] (mamba_ssm's path without causal-conv1d).
- `gdn-4x4096` (4 documents of 4096 tokens, 16 heads × 128, bf16 q, k, v, β, fp32 log decays; Qwen3-Next's and
  fla's layer shape): the chunked gated delta rule with its L2 norms as the Gated DeltaNet layer runs it: ours
  (blockzoo-gated-delta-net's Triton kernels), flash-linear-attention's `chunk_gated_delta_rule` (where fla refuses
  its backward, on Hopper with Triton < 3.7.1, that check lifted: a figure of its speed only, its issue #640 says
  its gradients are wrong there), and the package's torch chunked form, eager and compiled.
- `grouped-mixtral` (8 experts, 8192 tokens × top-2, hidden 4096, ffn 14336), `grouped-qwen3` (128 experts, 8192 ×
  top-8, hidden 2048, ffn 768): the experts' gate, up and down products, `torch._grouped_mm` (what blockzoo-moe runs)
  against one product per expert (and `F.grouped_mm` where torch has it).

Each contender reports its median time, GB/s (the minimal HBM traffic of the operation, stated per case) or TFLOP/s,
and its peak memory above what existed before it (inputs, weights), and its largest difference from ours (outputs
and input gradients, relative to their largest magnitude). Project rule: a kernel of ours stays only where it beats
torch.compile of the same code.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/kernels.py`: see llama.py (this very file would shadow `kernels`)
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
import torch.nn.functional as F

from benchmarks import harness

SUITE = "kernels"
# The Triton cross-entropy chunk's launches timed: (columns a block, warps); fewer, larger programs keep fewer rows in
# flight, so more of each is still in L2 when the gradient pass reads it again.
CROSS_ENTROPY_LAUNCHES = [(4096, 8), (8192, 16), (16384, 32)]
EPSILON = 1e-5
Q_HEADS, KV_HEADS, DOCUMENT = 32, 8, 4096
CONV_CHANNELS, CONV_KERNEL, CONV_OFFSET, IN_PROJ = 4352, 4, 4096, 8512  # mamba2-1.3b: in_proj = [z, x‖B‖C, dt]
CASES = {
    "rmsnorm-32768x2048": ("rmsnorm", {"tokens": 32768, "hidden": 2048}),
    "rmsnorm-16384x4096": ("rmsnorm", {"tokens": 16384, "hidden": 4096}),
    "add-rmsnorm-32768x2048": ("add-rmsnorm", {"tokens": 32768, "hidden": 2048}),
    "add-rmsnorm-16384x4096": ("add-rmsnorm", {"tokens": 16384, "hidden": 4096}),
    "rotary-4096x64": ("rotary", {"tokens": 4096, "head_size": 64}),
    "rotary-4096x128": ("rotary", {"tokens": 4096, "head_size": 128}),
    "rotary-8192x64": ("rotary", {"tokens": 8192, "head_size": 64}),
    "rotary-8192x128": ("rotary", {"tokens": 8192, "head_size": 128}),
    "swiglu-16384x8192": ("swiglu", {"tokens": 16384, "ffn": 8192}),
    "ce-128256": ("ce", {"tokens": 16384, "hidden": 2048, "vocab": 128256}),
    "ce-50288": ("ce", {"tokens": 16384, "hidden": 2048, "vocab": 50288}),
    "conv-16384": ("conv", {"tokens": 16384}),
    "conv-32768": ("conv", {"tokens": 32768}),
    "gdn-4x4096": ("gdn", {"tokens": 16384, "document": 4096, "heads": 16, "head_size": 128}),
    "grouped-mixtral": ("grouped", {"tokens": 8192, "top_k": 2, "experts": 8, "hidden": 4096, "ffn": 14336}),
    "grouped-qwen3": ("grouped", {"tokens": 8192, "top_k": 8, "experts": 128, "hidden": 2048, "ffn": 768}),
}
# --tiny: every size divided (heads, documents and kernel size kept small too)
TINY_SIZES = {"tokens": 64, "hidden": 32, "head_size": 16, "ffn": 32, "vocab": 96, "experts": 4, "heads": 2}


def tiny(shape: dict) -> dict:
    return {key: TINY_SIZES.get(key, value) for key, value in shape.items()}


def as_tuple(value) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def compiled(function: Callable) -> Callable:
    return torch.compile(function, dynamic=False)


def liger(name: str) -> Callable:
    """liger-kernel's functional op `name` (Absent when liger-kernel does not import)."""
    try:
        from liger_kernel.transformers import functional
    except ImportError as error:
        raise harness.Absent(f"liger-kernel does not import: {error}") from None
    return getattr(functional, name)


class Suite:
    def __init__(self, arguments, device: torch.device, runner: harness.Runner):
        self.arguments, self.device, self.runner = arguments, device, runner
        self.dtype = torch.bfloat16
        self.generator = torch.Generator(device=device).manual_seed(0)

    def randn(self, *shape: int, dtype: torch.dtype | None = None, scale: float = 1.0, grad: bool = True):
        tensor = torch.randn(shape, device=self.device, generator=self.generator, dtype=torch.float32) * scale
        return tensor.to(dtype or self.dtype).requires_grad_(grad)

    def run_case(
        self,
        name: str,
        shape: dict,
        inputs: Sequence[torch.Tensor],
        contenders: Sequence[tuple[str, Callable[[], Callable], bool]],
        *,
        bytes: float | None = None,
        flops: float | None = None,
        note: str | None = None,
        parameters: Sequence[torch.Tensor] = (),
    ) -> None:
        """Time each contender (name, factory → function of `inputs`, whether it is ours) forward + backward: the
        gradients of the outputs are fixed random tensors (cloned per contender: some kernels write into them);
        `parameters`: tensors the functions use besides `inputs` whose gradients are cleared and compared too."""
        case = harness.Case(SUITE, name, shape=shape, bytes=bytes, flops=flops, memory_delta=True)
        if note:
            case.notes.append(note)
        state: dict[str, list[torch.Tensor] | None] = {"reference": None, "output_grads": None}
        for contender, factory, ours in contenders:
            self.runner.run(case, contender, lambda f=factory: self.kernel(f, inputs, parameters, state), ours=ours)
        self.runner.finish(case)

    def kernel(
        self, factory: Callable[[], Callable], inputs: Sequence[torch.Tensor], parameters: Sequence, state: dict
    ) -> harness.Timing:
        function = factory()
        trainable = [tensor for tensor in [*inputs, *parameters] if tensor.requires_grad]
        output_grads: list[torch.Tensor] = []
        first: list[torch.Tensor] = []

        def step() -> None:
            for tensor in trainable:
                tensor.grad = None
            outputs = as_tuple(function(*inputs))
            if not output_grads:  # the case's random output gradients, made by its first contender
                if state["output_grads"] is None:
                    state["output_grads"] = [self.randn(*out.shape, dtype=out.dtype, grad=False) for out in outputs]
                output_grads.extend(grad.clone() for grad in state["output_grads"])
            torch.autograd.backward(outputs, output_grads[: len(outputs)])
            if not first:  # what the first call computed, to compare with ours
                first.extend([output.detach().float() for output in outputs])
                first.extend([tensor.grad.detach().float() for tensor in trainable])

        timing = harness.time_steps(step, warmup=self.arguments.warmup, steps=self.arguments.steps, device=self.device)
        for tensor in trainable:
            tensor.grad = None
        if state["reference"] is None:
            state["reference"] = first
        else:
            timing.extra["max Δ to ours"] = max_difference(first, state["reference"])
        return timing

    # -- the cases ---------------------------------------------------------------------------------------------

    def rmsnorm(self, name: str, shape: dict, residual: bool) -> None:
        from blockzoo.config import structure
        from blockzoo.distributed.config import DistributedConfig
        from blockzoo.distributed.runtime import Distributed
        from blockzoo.layers.config import NormalizationConfig
        from blockzoo.layers.dims import TensorDim
        from blockzoo.model.block import build_part

        tokens, hidden = shape["tokens"], shape["hidden"]
        distributed = Distributed(DistributedConfig(backend="gloo"), world_size=1, rank=0, local_rank=0)
        config = structure({"type": "rms_norm", "epsilon": EPSILON}, NormalizationConfig)
        norm = build_part(
            config, name="norm", hidden_dim=TensorDim("hidden", hidden), distributed=distributed, lr_scale=1.0
        ).to(self.device)
        x, weight = self.randn(tokens, hidden), norm.weight  # fp32 master weight, ones
        if residual:
            inputs = [x, self.randn(tokens, hidden)]

            def ours(x: torch.Tensor, r: torch.Tensor):
                added = x + r
                return norm(added), added

            contenders = [
                ("ours (add, then blockzoo RMSNorm)", lambda: ours, True),
                ("torch.compile of ours", lambda: compiled(ours), False),
                (
                    "liger fused_add_rms_norm",
                    lambda: functools.partial(liger("liger_fused_add_rms_norm"), W=weight, eps=EPSILON),
                    False,
                ),
            ]
            passes = 8
        else:
            inputs = [x]
            contenders = [
                ("ours (blockzoo RMSNorm)", lambda: norm, True),
                ("torch.compile of ours", lambda: compiled(norm), False),
                ("liger rms_norm", lambda: functools.partial(liger("liger_rms_norm"), W=weight, eps=EPSILON), False),
                ("torch F.rms_norm", lambda: lambda x: F.rms_norm(x, (hidden,), weight.to(x.dtype), EPSILON), False),
            ]
            passes = 5
        self.run_case(
            name,
            shape,
            inputs,
            contenders,
            bytes=passes * tokens * hidden * 2,
            parameters=[weight],
            note=f"GB/s: {passes} passes over tokens × hidden in bf16 (forward reads and writes, backward reads 3)",
        )

    def rotary(self, name: str, shape: dict) -> None:
        from blockzoo.config import structure
        from blockzoo.layers.base import Batch
        from blockzoo_attention.config import RotaryConfig
        from blockzoo_attention.rotary import apply_rotary, rotary_constants, rotary_tables

        tokens, head_size = shape["tokens"], shape["head_size"]
        document = min(DOCUMENT, tokens)
        batch = Batch([document] * (tokens // document), device=self.device)
        rotary = rotary_constants(structure({"type": "default", "theta": 10000.0}, RotaryConfig), head_size)
        tables = rotary_tables(rotary, batch)
        query, key = self.randn(tokens, Q_HEADS, head_size), self.randn(tokens, KV_HEADS, head_size)

        def ours(query: torch.Tensor, key: torch.Tensor):
            return apply_rotary(query, tables), apply_rotary(key, tables)

        def liger_rope() -> Callable:
            rope = liger("liger_rope")
            cos, sin = (table[None].to(self.dtype) for table in tables)

            def rotate(query: torch.Tensor, key: torch.Tensor):
                # transformers' layout: [batch, heads, tokens, head] views of [batch, tokens, heads, head]
                query, key = rope(query[None].transpose(1, 2), key[None].transpose(1, 2), cos, sin)
                return query.transpose(1, 2)[0], key.transpose(1, 2)[0]

            return rotate

        self.run_case(
            name,
            {**shape, "query_heads": Q_HEADS, "key_value_heads": KV_HEADS},
            [query, key],
            [
                ("ours (blockzoo_attention apply_rotary)", lambda: ours, True),
                ("torch.compile of ours", lambda: compiled(ours), False),
                ("liger rope", liger_rope, False),
            ],
            bytes=4 * tokens * (Q_HEADS + KV_HEADS) * head_size * 2,
            note="GB/s: queries and keys read and written forward and backward, bf16",
        )

    def swiglu(self, name: str, shape: dict) -> None:
        from blockzoo.layers.activations import ACTIVATIONS

        tokens, ffn = shape["tokens"], shape["ffn"]
        projected = self.randn(tokens, 2 * ffn)

        def ours(projected: torch.Tensor) -> torch.Tensor:
            gate, up = projected.split(ffn, dim=-1)
            return ACTIVATIONS["silu"](gate) * up

        def liger_swiglu() -> Callable:
            op = liger("liger_swiglu")
            return lambda projected: op(*projected.split(ffn, dim=-1))

        self.run_case(
            name,
            shape,
            [projected],
            [
                ("ours (blockzoo MLP gating)", lambda: ours, True),
                ("torch.compile of ours", lambda: compiled(ours), False),
                ("liger swiglu", liger_swiglu, False),
            ],
            bytes=8 * tokens * ffn * 2,
            note="GB/s: 8 passes over tokens × ffn in bf16 (forward reads 2, writes 1; backward reads 3, writes 2)",
        )

    def cross_entropy(self, name: str, shape: dict) -> None:
        tokens, hidden, vocab = shape["tokens"], shape["hidden"], shape["vocab"]
        hidden_states = self.randn(tokens, hidden)
        weight = self.randn(vocab, hidden, dtype=torch.float32, scale=hidden**-0.5)
        labels = torch.randint(0, vocab, (tokens,), device=self.device, generator=self.generator)
        labels[:: max(tokens // 64, 1)] = -100  # a few ignored, as at document ends

        def ours(kernel: str | None = None, launch: tuple[int, int] | None = None) -> Callable:
            """`launch`: the Triton chunk kernel's (columns a block, warps), set around each call."""
            try:
                from blockzoo.layers.cross_entropy import linear_cross_entropy
            except ImportError as error:
                raise harness.Absent(f"blockzoo has no fused linear cross-entropy: {error}") from None
            if kernel != "triton":
                return lambda hidden, weight: linear_cross_entropy(hidden, weight, labels, kernel=kernel)
            if self.device.type != "cuda":
                raise harness.Absent("the Triton chunk kernel runs on CUDA")
            from blockzoo.layers import cross_entropy_kernel as chunk_kernel

            def run(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                saved = chunk_kernel.BLOCK, chunk_kernel.WARPS
                chunk_kernel.BLOCK, chunk_kernel.WARPS = launch
                try:
                    return linear_cross_entropy(hidden, weight, labels, kernel="triton")
                finally:
                    chunk_kernel.BLOCK, chunk_kernel.WARPS = saved

            return run

        def materialized(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            logits = F.linear(hidden, weight.to(hidden.dtype))
            return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")

        def liger_cross_entropy() -> Callable:
            op = liger("liger_cross_entropy")
            return lambda hidden, weight: op(F.linear(hidden, weight.to(hidden.dtype)), labels, reduction="sum")

        def liger_fused() -> Callable:
            op = liger("liger_fused_linear_cross_entropy")
            return lambda hidden, weight: op(hidden, weight.to(hidden.dtype), labels, reduction="sum")

        self.run_case(
            name,
            shape,
            [hidden_states, weight],
            [
                ("ours (blockzoo linear_cross_entropy)", ours, True),
                ("ours, the compiled chunk", functools.partial(ours, "compiled"), True),
                *(
                    (
                        f"ours, the Triton chunk kernel ({block} columns × {warps} warps)",
                        functools.partial(ours, "triton", (block, warps)),
                        True,
                    )
                    for block, warps in CROSS_ENTROPY_LAUNCHES
                ),
                ("materialized logits, eager", lambda: materialized, False),
                ("materialized logits, torch.compile", lambda: compiled(materialized), False),
                ("liger cross_entropy (materialized logits)", liger_cross_entropy, False),
                ("liger fused_linear_cross_entropy", liger_fused, False),
            ],
            flops=3 * 2 * tokens * hidden * vocab,
            note="TFLOP/s: the logits' product and its two gradients; weight fp32 (master), hidden bf16",
        )

    def conv(self, name: str, shape: dict) -> None:
        from blockzoo.layers.base import Batch

        tokens = shape["tokens"]
        channels, width, offset = (CONV_CHANNELS, IN_PROJ, CONV_OFFSET) if not self.arguments.tiny else (48, 112, 32)
        document = min(DOCUMENT, tokens)
        documents = tokens // document
        batch = Batch([document] * documents, device=self.device)
        projected = self.randn(tokens, width)  # in_proj's output: the convolution reads its x‖B‖C columns
        weight = self.randn(channels, CONV_KERNEL, dtype=torch.float32, scale=0.5)
        bias = self.randn(channels, dtype=torch.float32, scale=0.1)

        def columns(projected: torch.Tensor) -> torch.Tensor:
            return projected[:, offset : offset + channels]

        def ours() -> Callable:
            from blockzoo_ssm import causal_conv1d

            return lambda projected, weight, bias: causal_conv1d(
                columns(projected), weight, bias, batch, activation="silu"
            )

        positions = batch.positions

        def shifted_taps(projected: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            x = columns(projected).float()
            output = x * weight[:, -1] + bias
            for shift in range(1, CONV_KERNEL):
                taps = F.pad(x[:-shift], (0, 0, shift, 0)) * (positions >= shift)[:, None]
                output = output + taps * weight[:, -1 - shift]
            return F.silu(output).to(projected.dtype)

        def cudnn(projected: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            x = columns(projected).view(documents, document, channels).transpose(1, 2)
            output = F.conv1d(
                x, weight.to(x.dtype).unsqueeze(1), bias.to(x.dtype), padding=CONV_KERNEL - 1, groups=channels
            )
            return F.silu(output[..., :document]).transpose(1, 2).reshape(tokens, channels)

        self.run_case(
            name,
            {**shape, "document": document, "channels": channels, "kernel": CONV_KERNEL},
            [projected, weight, bias],
            [
                ("ours (blockzoo_ssm.causal_conv1d)", ours, True),
                ("plain torch (shifted taps), eager", lambda: shifted_taps, False),
                ("plain torch (shifted taps), torch.compile", lambda: compiled(shifted_taps), False),
                ("cuDNN nn.Conv1d per document row (mamba_ssm's path)", lambda: cudnn, False),
            ],
            bytes=5 * tokens * channels * 2,
            note="GB/s: 5 passes over tokens × channels in bf16 (forward reads and writes, backward reads 2, writes 1)",
        )

    def grouped(self, name: str, shape: dict) -> None:
        tokens, top_k, experts = shape["tokens"], shape["top_k"], shape["experts"]
        hidden, ffn = shape["hidden"], shape["ffn"]
        routed = tokens * top_k
        # Tokens per expert as a router would spread them (multinomial around the mean), in expert order.
        choices = torch.randint(0, experts, (routed,), device=self.device, generator=self.generator)
        counts = torch.bincount(choices, minlength=experts)
        offsets = counts.cumsum(0).to(torch.int32)
        counts_list = counts.tolist()
        x = self.randn(routed, hidden)
        gate, up, down = (self.randn(experts, ffn, hidden, scale=hidden**-0.5) for _ in range(3))

        def with_grouped_mm(mm: Callable) -> Callable:
            def experts_forward(x, gate, up, down):
                projected = [mm(x, weight.transpose(1, 2), offs=offsets) for weight in (gate, up)]
                return mm(F.silu(projected[0]) * projected[1], down, offs=offsets)

            return experts_forward

        def grouped_mm() -> Callable:
            if not hasattr(torch, "_grouped_mm"):
                raise harness.Absent("this torch has no torch._grouped_mm")
            return with_grouped_mm(torch._grouped_mm)

        def functional_grouped_mm() -> Callable:
            if not hasattr(F, "grouped_mm"):
                raise harness.Absent("this torch has no torch.nn.functional.grouped_mm")
            return with_grouped_mm(F.grouped_mm)

        def loop(x, gate, up, down):
            outputs = []
            for expert, block in enumerate(x.split(counts_list)):
                outputs.append((F.silu(block @ gate[expert].t()) * (block @ up[expert].t())) @ down[expert])
            return torch.cat(outputs)

        self.run_case(
            name,
            {**shape, "routed": routed},
            [x, gate, up, down],
            [
                ("torch._grouped_mm (blockzoo-moe's)", grouped_mm, True),
                ("F.grouped_mm", functional_grouped_mm, False),
                ("one product per expert", lambda: loop, False),
            ],
            flops=3 * 2 * routed * hidden * ffn * 3,
            note="TFLOP/s: gate, up and down products and their gradients; bf16 weights",
        )

    def gdn(self, name: str, shape: dict) -> None:
        from blockzoo.layers.base import Batch
        from blockzoo_gated_delta_net.delta_rule import gated_delta_rule_from

        tokens, heads, size = shape["tokens"], shape["heads"], shape["head_size"]
        document = min(shape["document"], tokens)
        batch = Batch([document] * (tokens // document), device=self.device)
        q, k, v = (self.randn(tokens, heads, size) for _ in range(3))
        g = (-F.softplus(self.randn(tokens, heads, dtype=torch.float32, grad=False)) * 0.2).requires_grad_()
        beta = torch.sigmoid(self.randn(tokens, heads, grad=False)).requires_grad_()

        def rule(kernel: str) -> Callable:
            def run(q, k, v, g, beta):
                return gated_delta_rule_from(q, k, v, g, beta, batch, kernel=kernel)[0]

            return run

        def ours() -> Callable:
            if self.device.type != "cuda":
                raise harness.Absent("blockzoo's Triton kernels run on CUDA")
            return rule("triton")

        def fla() -> Callable:
            from blockzoo_gated_delta_net.delta_rule import fla_available, fla_backward_refused

            if self.device.type != "cuda" or not fla_available():
                raise harness.Absent("flash-linear-attention is not importable here (or no CUDA)")
            if fla_backward_refused():  # lifted for the rest of this process (no later case runs fla)
                import fla.ops.common.chunk_o as chunk_o

                chunk_o.TRITON_ABOVE_3_7_1 = True
            return rule("fla")

        self.run_case(
            name,
            shape,
            [q, k, v, g, beta],
            [
                ("ours (blockzoo-gated-delta-net's Triton kernels)", ours, True),
                ("fla chunk_gated_delta_rule", fla, False),
                ("torch chunked form (the CPU path), eager", lambda: rule("torch"), False),
                ("torch chunked form, torch.compile", lambda: compiled(rule("torch")), False),
            ],
            flops=3 * 7 * tokens * heads * size * size,
            note="TFLOP/s: the layer's count, 7 operations per state element and token forward, twice that backward",
        )

    def run(self, name: str) -> None:
        kind, shape = CASES[name]
        shape = tiny(shape) if self.arguments.tiny else shape
        if kind in ("rmsnorm", "add-rmsnorm"):
            self.rmsnorm(name, shape, residual=kind == "add-rmsnorm")
        else:
            getattr(self, {"ce": "cross_entropy"}.get(kind, kind))(name, shape)


def max_difference(values: Sequence[torch.Tensor], references: Sequence[torch.Tensor]) -> float:
    """The largest |value - reference| over pairs, each relative to its reference's largest magnitude."""
    if len(values) != len(references):
        return float("nan")
    worst = 0.0
    for value, reference in zip(values, references, strict=True):
        scale = float(reference.abs().max()) or 1.0
        worst = max(worst, float((value - reference).abs().max()) / scale)
    return worst


def main(argv: Sequence[str] | None = None) -> None:
    command = harness.parser(__doc__, list(CASES), default_cases=list(CASES), steps=20, warmup=3)
    arguments, device = harness.parse(command, argv)
    command_line = sys.argv if argv is None else ["benchmarks/kernels.py", *argv]
    suite = Suite(arguments, device, harness.Runner(SUITE, device, arguments.json, command_line))
    for case in arguments.cases:
        try:
            suite.run(case)
        except Exception as error:  # noqa: BLE001 - a case that cannot even set up is reported, the others run
            print(f"# {case}: could not set up: {harness.first_line(error)}", flush=True)
            harness.clean(device)


if __name__ == "__main__":
    main()
