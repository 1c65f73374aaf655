"""Suite `moe`: an MoE layer's forward + backward, ours against transformers' sparse-MoE blocks built by transformers.

    python benchmarks/moe.py [--cases mixtral qwen3-8192 qwen3-32768] [--steps 10] [--warmup 3] [--json PATH] [--tiny]

Cases: `mixtral` (8192 tokens, hidden 4096, ffn 14336, 8 experts top-2) against `MixtralSparseMoeBlock`; `qwen3-8192`
and `qwen3-32768` (128 experts top-8, hidden 2048, expert ffn 768, Qwen3-30B-A3B's layer) against
`Qwen3MoeSparseMoeBlock`. Ours: blockzoo-moe with fp32 master weights cast to bf16 in the layer, bf16 activations, and
the same layer with bf16 weights (what a bf16 block holds: the fp32-master figure pays the casts the bf16-weight peers
do not), on CUDA also with its small pieces compiled (`BLOCKZOO_MOE_COMPILE=1`: the gathers with their sums and the
gated activation, each one fused kernel, as under `training.compile`). At the Qwen3 shapes also torchtitan 0.3.0's MoE
(its `MoE` as its Qwen3 MoE models configure it: softmax router, top k renormalized, grouped GEMMs through
`torch._grouped_mm` in bf16) with fp32 and with bf16 weights, our weights copied in (its router runs in the weights'
dtype). Each transformers block runs in every experts implementation transformers offers here (`grouped_mm`,
`batched_mm`, `eager`; the one a model of the family gets by default is named in the case's notes), with fp32 weights
under bf16 autocast (as in training) and with bf16 weights; and with liger-kernel's experts (`LigerExperts`, its fused
Triton MoE, applied the documented way: `apply_liger_kernel_to_mixtral` / `apply_liger_kernel_to_qwen3_moe` with their
defaults, undone after). Our weights are copied into each block and its output compared to ours (relative L2 difference:
the routers' top-k may differ on near ties, ours routes in fp32); parameter counts asserted equal. TFLOP/s on the active
experts (`shapes.moe_layer_flops`).
Target: ours ≥ 1.3× the fastest peer at each shape.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):  # `python benchmarks/moe.py`: see llama.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from benchmarks import harness, shapes

SUITE = "moe"
CASES = {
    "mixtral": shapes.MIXTRAL,
    "qwen3-8192": shapes.QWEN3_MOE,
    "qwen3-32768": shapes.MoEShape(tokens=32768, hidden=2048, ffn=768, experts=128, top_k=8, family="qwen3_moe"),
}
TINY = {
    "mixtral": shapes.MOE_TINY,
    "qwen3-8192": shapes.MoEShape(tokens=64, hidden=32, ffn=16, experts=8, top_k=4, family="qwen3_moe"),
    "qwen3-32768": shapes.MoEShape(tokens=128, hidden=32, ffn=16, experts=8, top_k=4, family="qwen3_moe"),
}
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
LIGER = {"mixtral": "apply_liger_kernel_to_mixtral", "qwen3_moe": "apply_liger_kernel_to_qwen3_moe"}


@contextlib.contextmanager
def liger_experts(family: str):
    """transformers' `family` modeling with liger-kernel applied (its defaults: the experts become `LigerExperts`)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError as error:
        raise harness.Absent(f"liger-kernel does not import: {error}") from None
    apply = getattr(liger, LIGER[family], None)
    if apply is None:
        raise harness.Absent(f"this liger-kernel has no {LIGER[family]}")
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    with harness.restored(modeling):
        apply()
        yield


class Suite:
    def __init__(self, arguments, device: torch.device, runner: harness.Runner):
        self.arguments, self.device, self.runner = arguments, device, runner
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.weights: dict[str, torch.Tensor] | None = None  # ours, in transformers' names, on the CPU
        self.ours_weights: dict[str, torch.Tensor] | None = None  # ours, in our names, on the CPU
        self.output: torch.Tensor | None = None  # ours, on the CPU
        self.parameters = 0  # ours, in the current case

    def time(self, step) -> harness.Timing:
        return harness.time_steps(step, warmup=self.arguments.warmup, steps=self.arguments.steps, device=self.device)

    def run(self, name: str) -> None:
        shape = (TINY if self.arguments.tiny else CASES)[name]
        fields = ("tokens", "hidden", "ffn", "experts", "top_k")
        case = harness.Case(
            SUITE,
            name,
            shape={field: getattr(shape, field) for field in fields},
            tokens=shape.tokens,
            flops=shapes.moe_layer_flops(shape),
        )
        self.weights = self.output = self.ours_weights = None
        layer = shapes.our_layer(
            shapes.moe_layer(shape), kind="mlp", hidden=shape.hidden, device="cpu", initialize=False
        )
        self.parameters = shapes.parameter_count(layer)
        case.notes.append(f"{self.parameters} parameters")
        try:
            default = shapes.default_experts_implementation(shape)
            case.notes.append(f"transformers' default experts implementation for this family: {default}")
        except Exception as error:  # noqa: BLE001 - a note
            case.notes.append(f"transformers' default experts implementation unknown: {harness.first_line(error)}")
        generator = torch.Generator(device=self.device).manual_seed(0)
        hidden = torch.randn(shape.tokens, shape.hidden, device=self.device, generator=generator).to(self.dtype)
        output_grad = torch.randn_like(hidden)
        self.runner.run(case, "ours (blockzoo moe)", lambda: self.ours(shape, hidden, output_grad), ours=True)
        if self.device.type == "cuda" or self.arguments.tiny:
            self.runner.run(
                case,
                "ours (blockzoo moe), bf16 weights",
                lambda: self.ours(shape, hidden, output_grad, bf16_weights=True),
                ours=True,
            )
        if self.device.type == "cuda":
            self.runner.run(
                case,
                "ours (blockzoo moe), bf16 weights, compiled pieces",
                lambda: self.ours(shape, hidden, output_grad, bf16_weights=True, compiled_pieces=True),
                ours=True,
            )
        if shape.family == "qwen3_moe":
            for precision in ("fp32 weights", "bf16 weights"):
                self.runner.run(
                    case,
                    f"torchtitan MoE (grouped GEMMs), {precision}",
                    lambda p=precision: self.torchtitan(shape, hidden, output_grad, p),
                )
        family = "Mixtral" if shape.family == "mixtral" else "Qwen3-MoE"
        for precision in ("fp32 + autocast", "bf16 weights"):
            for implementation in IMPLEMENTATIONS:
                self.runner.run(
                    case,
                    f"transformers {family} block, {implementation}, {precision}",
                    lambda i=implementation, p=precision: self.transformers(shape, hidden, output_grad, i, p),
                )
        self.runner.run(
            case,
            f"transformers {family} block + liger-kernel experts, bf16 weights",
            lambda: self.transformers(shape, hidden, output_grad, None, "bf16 weights", liger=True),
        )
        self.runner.finish(case)

    def ours(
        self,
        shape: shapes.MoEShape,
        hidden: torch.Tensor,
        output_grad: torch.Tensor,
        *,
        bf16_weights: bool = False,
        compiled_pieces: bool = False,
    ) -> harness.Timing:
        from blockzoo.layers.base import Batch
        from blockzoo_moe.dispatch import COMPILE_VARIABLE

        layer = shapes.our_layer(shapes.moe_layer(shape), kind="mlp", hidden=shape.hidden, device=self.device.type)
        if bf16_weights:  # the same initial weights, held in bf16 (the layer's casts become no-ops)
            layer = layer.to(torch.bfloat16)
            hidden, output_grad = hidden.to(torch.bfloat16), output_grad.to(torch.bfloat16)
        else:
            self.ours_weights = {
                name: tensor.detach().to("cpu", copy=True) for name, tensor in layer.named_parameters()
            }
            weights = shapes.moe_to_transformers(self.ours_weights, shape)
            self.weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights.items()}

        def step() -> torch.Tensor:
            inputs = hidden.detach().requires_grad_()
            output = layer(inputs, Batch([shape.tokens], device=self.device))
            output.backward(output_grad)
            return output.detach()

        with mock.patch.dict(os.environ, {COMPILE_VARIABLE: "1" if compiled_pieces else "0"}):
            timing = self.time(step)
        if bf16_weights:
            timing.extra["output Δrel to ours"] = self.difference(timing.first_value)
        else:
            self.output = timing.first_value.float().cpu()
        return timing

    def difference(self, output: torch.Tensor) -> float | None:
        """Relative L2 difference of a contender's output to ours (fp32 master weights)."""
        if self.output is None:
            return None
        theirs = output.float().cpu().view_as(self.output)
        return float((theirs - self.output).norm() / self.output.norm())

    def torchtitan(
        self, shape: shapes.MoEShape, hidden: torch.Tensor, output_grad: torch.Tensor, precision: str
    ) -> harness.Timing:
        from benchmarks import titan_peer

        layer = titan_peer.moe_layer(shape, self.device)
        count = shapes.parameter_count(layer)
        if count != self.parameters:
            raise ValueError(f"torchtitan's MoE has {count} parameters, ours {self.parameters}")
        if self.ours_weights is not None:
            titan_peer.load(layer, titan_peer.moe_to_torchtitan(self.ours_weights, shape))
        if precision == "bf16 weights":
            layer = layer.to(torch.bfloat16)
        dtype = next(layer.parameters()).dtype

        def step() -> torch.Tensor:
            inputs = hidden.detach().to(dtype).view(1, *hidden.shape).requires_grad_()
            output = layer(inputs)
            output.backward(output_grad.to(output.dtype).view_as(output))
            return output.detach()

        timing = self.time(step)
        timing.extra["output Δrel to ours"] = self.difference(timing.first_value)
        return timing

    def transformers(
        self,
        shape: shapes.MoEShape,
        hidden: torch.Tensor,
        output_grad: torch.Tensor,
        implementation: str | None,
        precision: str,
        *,
        liger: bool = False,
    ) -> harness.Timing:
        with liger_experts(shape.family) if liger else contextlib.nullcontext():
            with torch.device(self.device):
                block = shapes.transformers_moe_block(shape, implementation)
            count = shapes.parameter_count(block)
            if count != self.parameters:
                raise ValueError(f"transformers' block has {count} parameters, ours {self.parameters}")
            if self.weights is not None:
                shapes.load_into(block, self.weights)
            autocast = precision == "fp32 + autocast"
            if not autocast:
                block = block.to(self.dtype)

            def step() -> torch.Tensor:
                inputs = hidden.detach().view(1, *hidden.shape).requires_grad_()
                with torch.autocast(self.device.type, dtype=self.dtype, enabled=autocast):
                    output = block(inputs)
                output = output[0] if isinstance(output, tuple) else output
                output.backward(output_grad.view_as(output))
                return output.detach()

            timing = self.time(step)
        if self.output is not None:
            timing.extra["output Δrel to ours"] = self.difference(timing.first_value)
        return timing


def main(argv: Sequence[str] | None = None) -> None:
    command = harness.parser(__doc__, list(CASES), default_cases=list(CASES), steps=10, warmup=3)
    arguments, device = harness.parse(command, argv)
    command_line = sys.argv if argv is None else ["benchmarks/moe.py", *argv]
    suite = Suite(arguments, device, harness.Runner(SUITE, device, arguments.json, command_line))
    for case in arguments.cases:
        suite.run(case)


if __name__ == "__main__":
    main()
