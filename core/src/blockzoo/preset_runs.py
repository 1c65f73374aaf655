"""The run config `blockzoo init PRESET` writes: the preset's model, and data, training and distributed sections
sized for it, with a comment on the memory it needs. Torch-free (the parameter count is the preset's own).

The layout: the fewest processes, a power of two, whose ZeRO 3 share of the training state (16 bytes a parameter:
`blockzoo.memory`) fits `STATE_BUDGET` of an 80 GiB GPU, leaving the rest for activations; one process runs
unsharded. The data are random tokens, so the file runs (and `blockzoo config` checks it) before a corpus is
prepared; the comment says how to put a prepared corpus in their place.
"""

from __future__ import annotations

import math

from blockzoo import memory, presets

GPU_MEMORY = 80 * 2**30
STATE_BUDGET = 48 * 2**30


def processes_for(parameters: int) -> int:
    needed = parameters * (memory.WEIGHT_BYTES + memory.GRADIENT_BYTES + memory.OPTIMIZER_BYTES) / STATE_BUDGET
    return 1 if needed <= 1 else 2 ** math.ceil(math.log2(needed))


def learning_rate(parameters: int) -> float:
    """Smaller rates for larger models, as published recipes do (Llama 3: 3e-4 at 8B, 1.5e-4 at 70B)."""
    return 6.0e-4 if parameters < 1e9 else 3.0e-4 if parameters < 1e10 else 1.5e-4


def run_config_text(name: str) -> str:
    """The YAML text of a run config training preset `name`."""
    entry = presets.entry(name)
    preset = entry.preset
    count = preset.parameters
    processes = processes_for(count)
    zero_stage = 3 if processes > 1 else 0
    state = memory.per_rank(count, data_parallel=processes, zero_stage=zero_stage)
    micro_batch = 4 if count < 1e9 else 1
    origin = "ours (a proxy, not a published model)" if preset.ours else f"published: {preset.published_parameters}"
    active = f", {presets.describe_count(preset.active_parameters)} active" if preset.active_parameters else ""
    launch = (
        "blockzoo train THIS_FILE"
        if processes == 1
        else f"torchrun --nnodes {max(1, processes // 8)} --nproc-per-node {min(processes, 8)} -m blockzoo train "
        "THIS_FILE"
    )
    lines = [
        f"# {name}: {preset.family}, {count:,} parameters{active} ({origin}), from {preset.source}",
        f"# Memory: {state.describe()} on {processes} process(es)"
        + (", ZeRO 3 over all of them" if processes > 1 else "")
        + f"; the weights alone take {memory.gib(count * 2)} in bf16.",
        f"# Launch: {launch}   (check it first: blockzoo config THIS_FILE --processes {processes})",
        "# Data: random tokens, to check the run end to end; for a corpus, `blockzoo prepare INPUT --output "
        "data/tokens --tokenizer tokenizer.json`",
        "# and data: {type: memmap, path: data/tokens, sequence_length: 4096, micro_batch_size: ...}.",
        "model:",
        f"  preset: {name}",
        "distributed:",
        f"  zero_stage: {zero_stage}",
        "  compute_dtype: bf16",
        "data:",
        "  type: random",
        "  sequence_length: 4096",
        f"  micro_batch_size: {micro_batch}",
        "training:",
        "  train_iters: 1000",
        f"  optimizer: {{type: adamw, learning_rate: {learning_rate(count):.1e}, weight_decay: 0.1}}",
        "  schedule: {warmup_iters: 100, decay: cosine}",
        "  gradient_clipping: 1.0",
        "  log_interval: 10",
        f"  output_dir: runs/{name}",
        "  checkpoint_interval: 200",
    ]
    return "\n".join(lines) + "\n"


def description(entry: presets.PresetEntry) -> str:
    preset = entry.preset
    kind = "ours, not a published model" if preset.ours else f"published: {preset.published_parameters}"
    note = "" if entry.available else f" (unavailable: {entry.install_hint()})"
    return f"{preset.family}, {presets.describe_count(preset.parameters)} parameters ({kind}){note}"
