"""Suite `mamba2`: a training step of the Mamba 2 LM shape (mamba2-1.3b: d 2048, 48 mamba_2 layers, state 128, head
64, expand 2, vocab 50288 tied, no MLP: 1.34B parameters), ours against mamba_ssm's `MambaLMHeadModel`; and the
layer alone, forward + backward, ours against mamba_ssm's `Mamba2`.

    python benchmarks/mamba2.py [--cases 2x4096 4x4096 8x4096 layer] [--ours SETTING ...] [--steps 6] [--warmup 3]
        [--json PATH] [--tiny]

The peer is built by mamba_ssm (imported through `blockzoo_ssm.import_mamba_ssm`, the project's one adapter) with
the `Mamba2` layer, its defaults otherwise (RMSNorm, residual in fp32, its fused Triton add+norm, which needs no
compiled extension) except `use_mem_eff_path=False` (its fused path needs the compiled causal-conv1d, which cannot
be built on the GPU machine: it runs nn.Conv1d then). fp32 master weights, bf16 autocast, fused AdamW, our initial
weights copied in (step-0 losses compared, relative tolerance 1e-3), parameter counts asserted equal; its loss is
transformers' recipe: the fp32 cross-entropy of the materialized logits. MFU = tokens/s × 6·N / 989 TFLOP/s.

The layer case is mixers/mamba_2/benchmarks/mamba2_layer.py's (8 documents of 2048 tokens, hidden 1024, 32 heads
× 64, state 128, chunk 256, bf16): ours runs packed documents, mamba_ssm's a [documents, length] batch under
autocast; TFLOP/s are our layer's FLOP count for both; the outputs are compared (relative L2 difference).

The SSD kernels' first call autotunes (76 s on the H200 with every config): `BLOCKZOO_SSD_AUTOTUNE` (unset: 2
configs per kernel) bounds it for both contenders, which share mamba_ssm's kernels. Targets: LM ≥ 1.3×
the peer's tokens/s at ≤ 0.6× its memory, 8×4096 fits; layer ≥ 1.0×.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/mamba2.py`: see llama.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
import torch.nn.functional as F

from benchmarks import harness, ours, shapes

SUITE = "mamba2"
# 2x4096: the peer's 4x4096 step needs more than an 80 GB card holds.
CASES = {"2x4096": (2, 4096), "4x4096": (4, 4096), "8x4096": (8, 4096), "layer": (8, 2048)}
TINY_LENGTH = 32
DEFAULT_OURS = {case: ["compile=none", "compile=blocks"] for case in ("2x4096", "4x4096", "8x4096")}
LAYER = shapes.Mamba2Shape(hidden=1024, layers=1, state=128, head_size=64, expand=2, vocab=0)
LOSS_TOLERANCE = 1e-3


def layer_flops(shape: shapes.Mamba2Shape, lengths: list[int]) -> tuple[int, int]:
    """Our mamba_2 layer's own (forward, backward) FLOP count over documents of `lengths`."""
    from blockzoo.layers.base import Batch

    layer = shapes.our_layer(
        shapes.mamba2_mixer(shape), kind="mixer", hidden=shape.hidden, device="cpu", initialize=False
    )
    return layer.flops(Batch(lengths))


def import_mamba_ssm() -> None:
    try:
        from blockzoo_ssm import import_mamba_ssm

        import_mamba_ssm()
    except ImportError as error:
        raise harness.Absent(f"mamba_ssm does not import: {error}") from None


class Suite:
    def __init__(self, arguments, device: torch.device, runner: harness.Runner):
        self.arguments, self.device, self.runner = arguments, device, runner
        self.shape = shapes.MAMBA2_TINY if arguments.tiny else shapes.MAMBA2_1B
        self.layer_shape = shapes.MAMBA2_TINY if arguments.tiny else LAYER
        self.model = shapes.mamba2_model(self.shape)
        self.parameters = shapes.parameter_count(shapes.our_model(self.model))
        self.weights: dict[str, torch.Tensor] | None = None
        self.losses: dict[str, float] = {}
        self.notes: list[str] = []
        self.layer_weights: dict[str, torch.Tensor] | None = None  # our layer's, in mamba_ssm's names, on the CPU
        self.layer_output: torch.Tensor | None = None

    def rows_and_length(self, case: str) -> tuple[int, int]:
        rows, length = CASES[case]
        return rows, TINY_LENGTH if self.arguments.tiny else length

    def tokens(self, case: str) -> torch.Tensor:
        rows, length = self.rows_and_length(case)
        return ours.random_tokens(rows, length, self.shape.vocab, self.device)

    def time(self, step) -> harness.Timing:
        return harness.time_steps(step, warmup=self.arguments.warmup, steps=self.arguments.steps, device=self.device)

    # -- the LM ----------------------------------------------------------------------------------------------------

    def prepare_reference(self, cases: Sequence[str]) -> None:
        lm_cases = [case for case in cases if case != "layer"]
        if not lm_cases:
            return
        try:
            convert = functools.partial(shapes.mamba2_to_mamba_ssm, layers=self.shape.layers)
            tokens = {case: self.tokens(case) for case in lm_cases}
            self.weights, self.losses = ours.reference(self.model, tokens, convert)
        except Exception as error:  # noqa: BLE001 - without them the peer keeps its own weights, reported
            self.notes.append(f"no reference weights or losses ({harness.first_line(error)}): peers use their own init")
        harness.clean(self.device)

    def run_lm(self, case_name: str, settings: Sequence[str]) -> None:
        rows, length = self.rows_and_length(case_name)
        tokens = rows * length
        case = harness.Case(
            SUITE,
            case_name,
            shape={"rows": rows, "length": length, "parameters": self.parameters},
            tokens=tokens,
            flops=shapes.mamba2_flops_per_token(self.parameters) * tokens,
            mfu=True,
            notes=list(self.notes),
        )
        if case_name in self.losses:
            case.notes.append(f"step-0 losses against our model's, {self.losses[case_name]:.5f}: tolerance 1e-3")
        for setting in settings:
            self.runner.run(case, ours.contender_name(setting), lambda s=setting: self.ours_lm(case_name, s), ours=True)
        self.runner.run(case, "mamba_ssm MambaLMHeadModel (Mamba2)", lambda: self.mamba_ssm_lm(case_name))
        self.runner.finish(case)

    def ours_lm(self, case: str, setting: str) -> harness.Timing:
        return ours.timed_training(
            self.model, setting, self.tokens(case), self.time, self.losses.get(case), LOSS_TOLERANCE
        )

    def mamba_ssm_lm(self, case: str) -> harness.Timing:
        import_mamba_ssm()
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        tokens = self.tokens(case)
        model = MambaLMHeadModel(shapes.mamba_ssm_config(self.shape), device=self.device, dtype=torch.float32)
        count = shapes.parameter_count(model)
        if count != self.parameters:
            raise ValueError(f"mamba_ssm's model has {count} parameters, ours {self.parameters}")
        if self.weights is not None:
            shapes.load_into(model, self.weights)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        labels = ours.next_token_labels(tokens)

        def loss() -> torch.Tensor:
            return F.cross_entropy(model(tokens).logits.flatten(0, 1).float(), labels, ignore_index=-100)

        timing = self.time(ours.peer_step(loss, optimizer, self.device))
        timing.extra = ours.loss_check(timing.first_value, self.losses.get(case), LOSS_TOLERANCE)
        return timing

    # -- the layer -------------------------------------------------------------------------------------------------

    def run_layer(self) -> None:
        documents, length = self.rows_and_length("layer")
        shape = self.layer_shape
        case = harness.Case(
            SUITE,
            "layer",
            shape={
                "documents": documents,
                "length": length,
                "hidden": shape.hidden,
                "heads": shape.heads,
                "head_size": shape.head_size,
                "state": shape.state,
                "chunk": shape.chunk,
            },
            tokens=documents * length,
        )
        case.flops = sum(layer_flops(shape, [length] * documents))
        generator = torch.Generator(device=self.device).manual_seed(0)
        hidden = torch.randn(documents * length, shape.hidden, device=self.device, generator=generator)
        hidden = hidden.to(torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        output_grad = torch.randn_like(hidden)
        self.runner.run(case, "ours (blockzoo mamba_2)", lambda: self.ours_layer(hidden, output_grad), ours=True)
        self.runner.run(
            case,
            "mamba_ssm Mamba2 (use_mem_eff_path=False)",
            lambda: self.mamba_ssm_layer(hidden.view(documents, length, -1), output_grad.view(documents, length, -1)),
        )
        self.runner.finish(case)

    def ours_layer(self, hidden: torch.Tensor, output_grad: torch.Tensor) -> harness.Timing:
        from blockzoo.layers.base import Batch

        documents, length = self.rows_and_length("layer")
        layer = shapes.our_layer(
            shapes.mamba2_mixer(self.layer_shape), kind="mixer", hidden=self.layer_shape.hidden, device=self.device.type
        )
        lengths = [length] * documents
        self.layer_weights = {
            name: tensor.detach().to("cpu", copy=True)
            for name, tensor in shapes.mamba2_mixer_to_mamba_ssm(dict(layer.named_parameters())).items()
        }

        def step() -> torch.Tensor:
            inputs = hidden.detach().requires_grad_()
            output = layer(inputs, Batch(lengths, device=self.device))
            output.backward(output_grad)
            return output.detach()

        timing = self.time(step)
        self.layer_output = timing.first_value.float().cpu()
        return timing

    def mamba_ssm_layer(self, hidden: torch.Tensor, output_grad: torch.Tensor) -> harness.Timing:
        import_mamba_ssm()
        from mamba_ssm.modules.mamba2 import Mamba2

        shape = self.layer_shape
        layer = Mamba2(
            d_model=shape.hidden, **shapes.mamba_ssm_layer_options(shape), device=self.device, dtype=torch.float32
        )
        mixer = shapes.mamba2_mixer(shape)
        ours_count = shapes.parameter_count(
            shapes.our_layer(mixer, kind="mixer", hidden=shape.hidden, device="cpu", initialize=False)
        )
        if shapes.parameter_count(layer) != ours_count:
            raise ValueError(f"mamba_ssm's Mamba2 has {shapes.parameter_count(layer)} parameters, ours {ours_count}")
        if self.layer_weights is not None:
            shapes.load_into(layer, self.layer_weights)

        def step() -> torch.Tensor:
            inputs = hidden.detach().requires_grad_()
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                output = layer(inputs)
            output.backward(output_grad)
            return output.detach()

        timing = self.time(step)
        if self.layer_output is not None:
            theirs = timing.first_value.float().cpu().flatten(0, 1)
            timing.extra["output Δrel to ours"] = float((theirs - self.layer_output).norm() / theirs.norm())
        return timing


def main(argv: Sequence[str] | None = None) -> None:
    command = harness.parser(__doc__, list(CASES), default_cases=list(CASES), steps=6, warmup=3)
    command.add_argument("--ours", nargs="+", metavar="SETTING", help="our settings for the LM cases")
    arguments, device = harness.parse(command, argv)
    runner = harness.Runner(
        SUITE, device, arguments.json, sys.argv if argv is None else ["benchmarks/mamba2.py", *argv]
    )
    suite = Suite(arguments, device, runner)
    suite.prepare_reference(arguments.cases)
    for case in arguments.cases:
        if case == "layer":
            suite.run_layer()
        else:
            suite.run_lm(case, arguments.ours or DEFAULT_OURS[case])


if __name__ == "__main__":
    main()
