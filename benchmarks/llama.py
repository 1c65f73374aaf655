"""Suite `llama`: a training step of the Llama-1B shape (d 2048, 16 layers, 32 heads / 8 key-value heads × 64, ffn
8192, vocab 128256, tied: 1.236B parameters), ours against transformers' LlamaForCausalLM built by transformers.

    python benchmarks/llama.py [--cases 4x4096 8x4096 16x4096] [--ours SETTING ...] [--peers PEER ...]
        [--torchtitan OPTIONS] [--steps 6] [--warmup 3] [--json PATH] [--tiny]

Peers, each in the same process with the same tokens and our initial weights copied in (their step-0 loss is
compared to ours, relative tolerance 1e-3): `transformers` (sdpa, eager), `transformers-compile` (the same model
under torch.compile; its compile time is the "first call +s" column), `liger` (transformers with liger-kernel applied
the documented way, `apply_liger_kernel_to_llama()`: rotary, RMSNorm, SwiGLU, fused linear cross-entropy; it
patches transformers' classes globally, so it runs last in each case and the patch is undone after it),
`torchtitan` (torchtitan 0.3.0's Llama 3 built from its own config helpers: fused QKV, complex rotary, block-causal
FlexAttention on a GPU, its causal ScaledDotProductAttention on the CPU, where FlexAttention has no backward; its
per-block compile and activation checkpointing as `--torchtitan` selects, applied as its `parallelize_llama` does;
its cross-entropy loss, compiled with the model as torchtitan's default) and `torchtitan-float8` (the same with
torchtitan's `Float8LinearConverter` swapping every linear whose dims divide by 16, the tied head included, for
torchao's Float8Linear, tensorwise recipe; torchao's emulation on the CPU, where compile is then off as torchtitan
requires). Every peer: fp32 master weights, bf16 autocast (torchtitan trains with FSDP2 mixed precision, bf16
parameters in the matmuls and fp32 gradient reduction: on one device without the FSDP wrapper that is autocast),
fused AdamW; ours: compute_dtype bf16, our AdamW. Parameter counts are asserted equal.
MFU = tokens/s × (6·N + 12·layers·heads·head_size·length) / 989 TFLOP/s.

Ours runs in each `--ours` setting (`compile=blocks,recompute=selective`...; see benchmarks/ours.py); the default
settings and peers of each case are in DEFAULTS. Targets: ours ≥ 1.15× liger's tokens/s at ≤ its peak
memory at 4×4096 and 8×4096, ahead of compiled transformers; 16×4096 fits.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/llama.py`: import the suite as the package `benchmarks`, and keep
    # this folder off the path (its kernels.py would shadow the `kernels` package transformers looks for).
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from benchmarks import harness, ours, shapes

SUITE = "llama"
CASES = {"4x4096": (4, 4096), "8x4096": (8, 4096), "16x4096": (16, 4096)}
TINY_LENGTH = 32  # --tiny: the same rows, sequences of 32 tokens
PEERS = ("transformers", "transformers-compile", "liger", "torchtitan", "torchtitan-float8")
# Per case: our settings and the peers run unless --ours / --peers say otherwise (each compiling contender costs
# its compilation: the default stays within a few minutes). transformers eager ran out of memory at 8×4096 on the
# H200 (2026-11-29) and compiling it again per shape costs a minute: 4×4096 has every peer.
DEFAULTS = {
    "4x4096": (["compile=blocks"], PEERS),
    "8x4096": (["compile=blocks"], ("liger", "torchtitan", "torchtitan-float8")),
    # with recomputation (its cost shows against 8x4096's tokens/s)
    "16x4096": (["compile=blocks,recompute=selective"], ("liger", "torchtitan")),
}
# torchtitan's options per case unless --torchtitan says otherwise: `compile` (its per-block torch.compile and compiled
# loss), `checkpointing=full|selective` (its FullAC / SelectiveAC), `eager` (neither); as our settings of the case.
TORCHTITAN_DEFAULTS = {"4x4096": "compile", "8x4096": "compile", "16x4096": "compile,checkpointing=selective"}
LOSS_TOLERANCE = 1e-3  # relative, step-0 loss of a contender against our model's (anchors §7)
FLOAT8_LOSS_TOLERANCE = 1e-2  # float8 matmuls round each operand to 3 mantissa bits: a looser bound, reported apart


@contextlib.contextmanager
def liger_patched():
    """transformers' Llama with liger-kernel applied (its defaults), restored on exit."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as error:
        raise harness.Absent(f"liger-kernel does not import: {error}") from None
    from transformers.models.llama import modeling_llama

    with harness.restored(modeling_llama):
        apply_liger_kernel_to_llama()
        yield


class Suite:
    def __init__(self, arguments, device: torch.device, runner: harness.Runner):
        self.arguments, self.device, self.runner = arguments, device, runner
        self.shape = shapes.LLAMA_TINY if arguments.tiny else shapes.LLAMA_1B
        self.model = shapes.llama_model(self.shape)
        self.parameters = shapes.parameter_count(shapes.our_model(self.model))
        self.weights: dict[str, torch.Tensor] | None = None  # ours, initial, in transformers' names, on the CPU
        self.losses: dict[str, float] = {}  # case -> our model's loss on its tokens before any step
        self.notes: list[str] = []

    def tokens(self, case: str) -> torch.Tensor:
        rows, length = CASES[case]
        length = TINY_LENGTH if self.arguments.tiny else length
        return ours.random_tokens(rows, length, self.shape.vocab, self.device)

    def prepare_reference(self, cases: Sequence[str]) -> None:
        """Our initial weights (copied into every peer) and our model's loss on each case's tokens."""
        try:
            convert = functools.partial(shapes.llama_to_transformers, layers=self.shape.layers)
            self.weights, self.losses = ours.reference(self.model, {case: self.tokens(case) for case in cases}, convert)
        except Exception as error:  # noqa: BLE001 - without them the peers keep their own weights, reported
            self.notes.append(f"no reference weights or losses ({harness.first_line(error)}): peers use their own init")
        harness.clean(self.device)

    def run(self, case_name: str, settings: Sequence[str], peers: Sequence[str]) -> None:
        rows, length = CASES[case_name]
        length = TINY_LENGTH if self.arguments.tiny else length
        tokens = rows * length
        case = harness.Case(
            SUITE,
            case_name,
            shape={"rows": rows, "length": length, "parameters": self.parameters},
            tokens=tokens,
            flops=shapes.llama_flops_per_token(self.shape, self.parameters, length) * tokens,
            mfu=True,
            notes=list(self.notes),
        )
        if case_name in self.losses:
            case.notes.append(
                f"step-0 losses against our model's, {self.losses[case_name]:.5f}: tolerance 1e-3 relative"
            )
        for setting in settings:
            self.runner.run(case, ours.contender_name(setting), lambda s=setting: self.ours(case_name, s), ours=True)
        names = {
            "transformers": "transformers (sdpa)",
            "transformers-compile": "transformers (sdpa) + torch.compile",
            "liger": "transformers + liger-kernel",
        }
        for peer in [peer for peer in PEERS if peer in peers and peer in names]:  # liger last: it patches transformers
            self.runner.run(case, names[peer], lambda p=peer: self.transformers(case_name, p))
        options = torchtitan_options(self.arguments.torchtitan or TORCHTITAN_DEFAULTS[case_name])
        if self.device.type != "cuda":
            options["compile"] = False  # --tiny on the CPU: eager (torchtitan refuses compile with float8 emulation)
        described = ", ".join(
            ["compile"] * options["compile"]
            + [f"{options['checkpointing']} checkpointing"] * bool(options["checkpointing"])
        )
        for peer, float8 in (("torchtitan", None), ("torchtitan-float8", "tensorwise")):
            if peer in peers:
                name = f"torchtitan Llama 3 ({described or 'eager'}{', float8 ' + float8 if float8 else ''})"
                self.runner.run(case, name, lambda f=float8: self.torchtitan(case_name, options, f))
        self.runner.finish(case)

    def time(self, step) -> harness.Timing:
        return harness.time_steps(step, warmup=self.arguments.warmup, steps=self.arguments.steps, device=self.device)

    def ours(self, case: str, setting: str) -> harness.Timing:
        return ours.timed_training(
            self.model, setting, self.tokens(case), self.time, self.losses.get(case), LOSS_TOLERANCE
        )

    def transformers(self, case: str, peer: str) -> harness.Timing:
        tokens = self.tokens(case)
        with liger_patched() if peer == "liger" else contextlib.nullcontext():
            from transformers import LlamaForCausalLM

            config = shapes.transformers_llama_config(self.shape, tokens.shape[1])
            with torch.device(self.device):
                model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
            count = shapes.parameter_count(model)
            if count != self.parameters:
                raise ValueError(f"transformers' model has {count} parameters, ours {self.parameters}")
            if self.weights is not None:
                shapes.load_into(model, self.weights)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=self.device.type == "cuda")
            forward = torch.compile(model) if peer == "transformers-compile" else model
            timing = self.time(
                ours.peer_step(lambda: forward(input_ids=tokens, labels=tokens).loss, optimizer, self.device)
            )
        timing.extra = ours.loss_check(timing.first_value, self.losses.get(case), LOSS_TOLERANCE)
        return timing

    def torchtitan(self, case: str, options: dict, float8: str | None) -> harness.Timing:
        from benchmarks import titan_peer

        tokens = self.tokens(case)
        cuda = self.device.type == "cuda"
        config = titan_peer.llama_config(
            self.shape, tokens.shape[1], attention="flex" if cuda else "sdpa", float8=float8, emulate=not cuda
        )
        model = titan_peer.build_llama(config, self.device)
        count = shapes.parameter_count(model)
        if count != self.parameters:
            raise ValueError(f"torchtitan's model has {count} parameters, ours {self.parameters}")
        if self.weights is not None:
            titan_peer.load(model, titan_peer.transformers_to_torchtitan(self.weights, self.shape))
        titan_peer.apply_policies(model, compile=options["compile"], checkpointing=options["checkpointing"])
        loss_function = titan_peer.cross_entropy(compile=options["compile"])
        labels = ours.next_token_labels(tokens).view_as(tokens)
        labelled = int((labels != -100).sum())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

        def loss() -> torch.Tensor:
            return loss_function(titan_peer.llama_logits(model, tokens), labels) / labelled

        timing = self.time(ours.peer_step(loss, optimizer, self.device))
        tolerance = LOSS_TOLERANCE if float8 is None else FLOAT8_LOSS_TOLERANCE
        timing.extra = ours.loss_check(timing.first_value, self.losses.get(case), tolerance)
        return timing


def torchtitan_options(text: str) -> dict:
    """`compile,checkpointing=selective` (or `eager`) as {"compile": bool, "checkpointing": None | full | selective}."""
    options: dict = {"compile": False, "checkpointing": None}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key == "compile" and not value:
            options["compile"] = True
        elif key == "checkpointing" and value in ("full", "selective"):
            options["checkpointing"] = value
        elif key != "eager" or value:
            raise ValueError(f"--torchtitan takes compile, checkpointing=full|selective or eager, got {item!r}")
    return options


def main(argv: Sequence[str] | None = None) -> None:
    command = harness.parser(__doc__, list(CASES), default_cases=list(CASES), steps=6, warmup=3)
    command.add_argument("--ours", nargs="+", metavar="SETTING", help="our settings (default: per case, DEFAULTS)")
    command.add_argument("--peers", nargs="+", choices=PEERS, metavar="PEER", help=f"of {', '.join(PEERS)}")
    command.add_argument(
        "--torchtitan", metavar="OPTIONS", help="compile, checkpointing=full|selective, eager (default: per case)"
    )
    arguments, device = harness.parse(command, argv)
    runner = harness.Runner(SUITE, device, arguments.json, sys.argv if argv is None else ["benchmarks/llama.py", *argv])
    suite = Suite(arguments, device, runner)
    suite.prepare_reference(arguments.cases)
    for case in arguments.cases:
        settings, peers = DEFAULTS[case]
        suite.run(case, arguments.ours or settings, arguments.peers or peers)


if __name__ == "__main__":
    main()
