"""Suite `hybrid`: a training step of a Gated DeltaNet + attention hybrid LM with Qwen3-Next's layers and its 3:1
pattern, ours against transformers' `Qwen3NextForCausalLM`.

    python benchmarks/hybrid.py [--cases 2x4096 4x4096 8x4096] [--ours SETTING ...] [--steps 6] [--warmup 3]
        [--json PATH] [--tiny]

The shape (HYBRID_1B, ~1.2B parameters): d 2048, 16 layers, every fourth gated attention (16 heads × 256, 2
key-value heads, an output gate, q/k norms, rotary on a quarter of each head), the others Gated DeltaNet (16 key
heads × 128, 32 value heads × 128, convolution of 4), a dense SwiGLU MLP of 4096 in every layer (Qwen3-Next's own
MLP is a mixture of experts: the moe suite measures that part), vocabulary 151936, tied embeddings.

The model is written once, as a transformers config.json of the qwen3_next format: ours is what
blockzoo-huggingface imports from it, and the peer gets our initial weights through that format's export (our model
saved in the qwen3_next format to a temporary directory, loaded by `from_pretrained`), so both compute the same
model: parameter counts asserted equal, step-0 losses compared (relative tolerance 1e-3). transformers takes
flash-linear-attention's kernels where fla is installed (its chunked gated delta rule, its gated RMSNorm); fla
refuses its gated backward on Hopper with Triton < 3.7.1 (its issue #640: wrong gradients), so there the check is
lifted for this process, as the kernels suite does: a figure of its speed, not of a correct training step.
causal-conv1d is absent on the GPU machine: transformers' convolution is then torch's. Every peer: fp32 master
weights, bf16 autocast, fused AdamW, its own loss (`labels=`); ours: compute_dtype bf16, our AdamW.
MFU = tokens/s × our model's own FLOP count (`LanguageModel.flops`: matmuls, attention, the delta rule) / 989 TFLOP/s.

Target: ours ≥ 1.2× the peer's tokens/s at ≤ its peak memory.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/hybrid.py`: see llama.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from benchmarks import harness, ours, shapes

SUITE = "hybrid"
# 2x4096: transformers' 4x4096 step needs more than an 80 GB card holds.
CASES = {"2x4096": (2, 4096), "4x4096": (4, 4096), "8x4096": (8, 4096)}
DEFAULT_CASES = ["4x4096"]
DEFAULT_OURS = ["compile=blocks"]
TINY_LENGTH = 32
LOSS_TOLERANCE = 1e-3
FORMAT = "qwen3_next"

HYBRID_1B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
HYBRID_TINY = HYBRID_1B | {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "intermediate_size": 128,
}


def config_json(shape: dict) -> dict:
    """The config.json of a dense Qwen3-Next model of `shape`: every layer's MLP dense (`mlp_only_layers`)."""
    layers = shape["num_hidden_layers"]
    return {
        "model_type": FORMAT,
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_act": "silu",
        **shape,
        "mlp_only_layers": list(range(layers)),
    }


def our_model(shape: dict) -> dict:
    """Our `model:` config of the shape, as blockzoo-huggingface imports it."""
    from blockzoo.conversion import get_format

    return get_format(FORMAT).import_config(config_json(shape))


def delta_rule_note() -> str:
    """Which gated delta rule transformers' layer runs here (and whether fla's backward check is lifted)."""
    from blockzoo_gated_delta_net.delta_rule import fla_available, fla_backward_refused

    if not (torch.cuda.is_available() and fla_available()):
        return "transformers' delta rule: its torch path (flash-linear-attention absent or no CUDA)"
    if fla_backward_refused():
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True  # lifted for the rest of this process: timing only (see the docstring)
        return "transformers' delta rule: fla's kernels, their Hopper backward check lifted (speed only, fla #640)"
    return "transformers' delta rule: fla's kernels"


class Suite:
    def __init__(self, arguments, device: torch.device, runner: harness.Runner):
        self.arguments, self.device, self.runner = arguments, device, runner
        self.shape = HYBRID_TINY if arguments.tiny else HYBRID_1B
        self.model = our_model(self.shape)
        self.parameters = shapes.parameter_count(shapes.our_model(self.model))
        self.exported: Path | None = None  # our initial weights in the qwen3_next format
        self.losses: dict[str, float] = {}
        self.notes: list[str] = []
        self._directory = tempfile.TemporaryDirectory(prefix="blockzoo-hybrid-")

    def rows_and_length(self, case: str) -> tuple[int, int]:
        rows, length = CASES[case]
        return rows, TINY_LENGTH if self.arguments.tiny else length

    def tokens(self, case: str) -> torch.Tensor:
        rows, length = self.rows_and_length(case)
        return ours.random_tokens(rows, length, self.shape["vocab_size"], self.device)

    def time(self, step) -> harness.Timing:
        return harness.time_steps(step, warmup=self.arguments.warmup, steps=self.arguments.steps, device=self.device)

    def prepare_reference(self, cases: Sequence[str]) -> None:
        """Our model as built from the seed: saved in the qwen3_next format (the peer's weights) and its loss on each
        case's tokens before any step."""
        import blockzoo

        try:
            built, _ = ours.build(ours.run_config(self.model, "default", rows=1, length=1))
            self.losses = {case: ours.reference_loss(built, self.tokens(case)) for case in cases}
            self.exported = blockzoo.save(built, Path(self._directory.name) / FORMAT, format=FORMAT)
            del built
        except Exception as error:  # noqa: BLE001 - without them the peer keeps its own weights, reported
            self.notes.append(f"no reference weights or losses ({harness.first_line(error)}): peers use their own init")
        harness.clean(self.device)

    def flops(self, rows: int, length: int) -> float:
        from blockzoo.layers.base import Batch

        return float(sum(shapes.our_model(self.model).flops(Batch([length] * rows))))

    def run(self, case_name: str, settings: Sequence[str]) -> None:
        rows, length = self.rows_and_length(case_name)
        case = harness.Case(
            SUITE,
            case_name,
            shape={"rows": rows, "length": length, "parameters": self.parameters},
            tokens=rows * length,
            flops=self.flops(rows, length),
            mfu=True,
            notes=[*self.notes],
        )
        if case_name in self.losses:
            case.notes.append(f"step-0 losses against our model's, {self.losses[case_name]:.5f}: tolerance 1e-3")
        for setting in settings:
            self.runner.run(case, ours.contender_name(setting), lambda s=setting: self.ours(case_name, s), ours=True)
        case.notes.append(delta_rule_note())
        self.runner.run(case, "transformers Qwen3NextForCausalLM", lambda: self.transformers(case_name))
        self.runner.finish(case)

    def ours(self, case: str, setting: str) -> harness.Timing:
        return ours.timed_training(
            self.model, setting, self.tokens(case), self.time, self.losses.get(case), LOSS_TOLERANCE
        )

    def transformers(self, case: str) -> harness.Timing:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        tokens = self.tokens(case)
        if self.exported is not None:
            model = Qwen3NextForCausalLM.from_pretrained(self.exported, dtype=torch.float32).to(self.device)
        else:
            with torch.device(self.device):
                model = Qwen3NextForCausalLM(Qwen3NextConfig(**config_json(self.shape)))
        count = shapes.parameter_count(model)
        if count != self.parameters:
            raise ValueError(f"transformers' model has {count} parameters, ours {self.parameters}")
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=self.device.type == "cuda")
        timing = self.time(ours.peer_step(lambda: model(input_ids=tokens, labels=tokens).loss, optimizer, self.device))
        timing.extra = ours.loss_check(timing.first_value, self.losses.get(case), LOSS_TOLERANCE)
        return timing


def main(argv: Sequence[str] | None = None) -> None:
    command = harness.parser(__doc__, list(CASES), default_cases=DEFAULT_CASES, steps=6, warmup=3)
    command.add_argument("--ours", nargs="+", metavar="SETTING", help=f"our settings (default: {DEFAULT_OURS})")
    arguments, device = harness.parse(command, argv)
    argv_text = sys.argv if argv is None else ["benchmarks/hybrid.py", *argv]
    runner = harness.Runner(SUITE, device, arguments.json, argv_text)
    suite = Suite(arguments, device, runner)
    suite.prepare_reference(arguments.cases)
    for case in arguments.cases:
        suite.run(case, arguments.ours or DEFAULT_OURS)


if __name__ == "__main__":
    main()
