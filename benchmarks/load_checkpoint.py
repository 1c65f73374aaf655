"""Loading and saving a checkpoint on the CPU: blockzoo against transformers, in one run, fp32.

Loading: `blockzoo.load` of a native checkpoint and of a Hugging Face directory against transformers'
`from_pretrained` of the same directory, until every weight is in memory (transformers maps the files and reads a
tensor when it is first used, so every parameter is read once, summed, before the clock stops). Saving: `blockzoo.save`
of the loaded model as a native checkpoint and as a Hugging Face directory (`format="llama"`) against transformers'
`save_pretrained` of its loaded model, alone and followed by an fsync of every file it wrote: blockzoo's saves are
durable (synced before they are renamed into place), transformers' leaves its bytes in the page cache, so on a slow
disk the second row is the like-for-like one; and the export with `durable=False` (`blockzoo convert --no-fsync`),
unsynced like `save_pretrained`.

Each contender runs in a process of its own (so that its peak RSS, VmHWM, is its own): it imports its library,
then loads (or saves) `--repeats` times; it reports the first time (with whatever a first load does once: blockzoo
verifies a native checkpoint's checksums once per process), the best time, its resident memory after the imports and
its peak, and the CPU seconds of the process (all its threads, user + system) for each: on a busy machine the wall
time follows the load, the CPU seconds much less. Prints the seconds, the peaks and the ratios (time: transformers /
blockzoo, > 1: blockzoo is faster; peak: blockzoo / transformers). Run it with `OMP_NUM_THREADS=1` on a shared
machine.

`python benchmarks/load_checkpoint.py [--hidden 2048 --layers 8 ...]` (needs blockzoo-attention, blockzoo-mlp,
blockzoo-huggingface and transformers). The default is a Llama-shaped model of 486M parameters.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Not this script's directory on the import path: its kernels.py (a benchmark suite) would shadow the `kernels`
# package that transformers imports.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# The last two load the directory `save_pretrained` wrote (in the save-transformers process): its key‖value parts,
# and gate‖up where biases sit between them, are not end to end in the file, so blockzoo copies them.
CONTENDERS = (
    "load-native",
    "load-hf",
    "load-transformers",
    "save-blockzoo",
    "save-transformers",
    "load-theirs",
    "load-theirs-transformers",
)
# The directory each loading contender reads.
SOURCES = {
    "load-native": "native",
    "load-hf": "hf",
    "load-transformers": "hf",
    "save-blockzoo": "hf",
    "save-transformers": "hf",
    "load-theirs": "hf-transformers",
    "load-theirs-transformers": "hf-transformers",
}


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key)) / 1024


def _resident_mib() -> float:
    return _status_mib("VmRSS")


def _peak_mib() -> float:
    # VmHWM, this process's own peak: getrusage's ru_maxrss keeps the parent's peak across fork and exec.
    return _status_mib("VmHWM")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _save_pretrained_synced(model, target: Path) -> None:
    model.save_pretrained(target)
    for path in [target, *target.iterdir()]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _sum_parameters(model) -> None:
    import torch

    with torch.no_grad():
        sum(float(parameter.sum()) for parameter in model.parameters())


def _child(kind: str, directory: Path, repeats: int) -> dict:
    """One contender's figures (run in its own process)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    source = directory / SOURCES[kind]
    if kind.endswith("transformers"):
        import transformers

        transformers.utils.logging.disable_progress_bar()

        def load():
            return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    else:
        import blockzoo

        def load():
            return blockzoo.load(source)

        blockzoo.save  # noqa: B018 - the API's imports done before the clock
    figures: dict = {"after_imports_mib": _resident_mib(), "times": {}, "cpu": {}}

    def timed(name: str, action, *arguments, **options) -> None:
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        action(*arguments, **options)
        figures["times"].setdefault(name, []).append(time.perf_counter() - start)
        figures["cpu"].setdefault(name, []).append(_cpu_seconds() - cpu_start)

    if kind.startswith("load"):
        for _ in range(repeats):
            model = None

            def load_and_read():
                nonlocal model
                model = load()
                _sum_parameters(model)

            timed("load", load_and_read)
            del model
            gc.collect()
    else:
        model = load()
        _sum_parameters(model)
        for repeat in range(repeats):
            target = directory / f"saved-{kind}-{repeat}"
            if kind == "save-transformers":
                timed("save", model.save_pretrained, target / "hf")
                shutil.rmtree(target)
                timed("save synced", _save_pretrained_synced, model, target / "hf")
            else:
                timed("save native", blockzoo.save, model, target / "native")
                timed("save hf", blockzoo.save, model, target / "hf", format="llama")
                shutil.rmtree(target / "hf")
                timed("save hf unsynced", blockzoo.save, model, target / "hf", format="llama", durable=False)
            shutil.rmtree(target)
        if kind == "save-transformers":  # the directory the load-theirs contenders read
            model.save_pretrained(directory / "hf-transformers")
    figures["peak_mib"] = _peak_mib()
    return figures


def _run_child(kind: str, directory: Path, repeats: int) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--directory", str(directory), "--repeats", str(repeats)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"{kind} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--directory", type=Path, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        print(json.dumps(_child(arguments.child, arguments.directory, arguments.repeats)))
        return

    import torch

    import blockzoo

    mixer = {
        "type": "attention",
        "heads": arguments.heads,
        "head_groups": arguments.kv_heads,
        "head_size": arguments.hidden // arguments.heads,
        "rotary": {"type": "default"},
    }
    mlp = {"type": "mlp", "intermediate_size": arguments.intermediate, "gated": True}
    model = blockzoo.build(
        {
            "model": {
                "hidden_size": arguments.hidden,
                "embeddings": {"vocab_size": arguments.vocab},
                "decoder": {"num_blocks": arguments.layers, "block": {"mixer": mixer, "mlp": mlp}},
            }
        }
    )
    parameters = sum(parameter.numel() for parameter in model.parameters())
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        blockzoo.save(model, directory / "native")
        blockzoo.save(model, directory / "hf", format="llama")
        del model
        figures = {}
        for kind in CONTENDERS:  # each said as it comes (a slow machine: something before a time limit)
            figures[kind] = _run_child(kind, directory, arguments.repeats)
            print(f"{kind}: {json.dumps(figures[kind])}", flush=True)

    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    print(f"{parameters / 1e6:.0f}M parameters, fp32, CPU ({threads} threads), best of {arguments.repeats}")
    print(f"{'contender':<46} {'first s':>8} {'best s':>8} {'best CPU s':>11} {'imports MiB':>12} {'peak MiB':>9}")
    rows = [
        ("blockzoo.load(native checkpoint)", "load-native", "load"),
        ("blockzoo.load(Hugging Face directory)", "load-hf", "load"),
        ("transformers from_pretrained(same directory)", "load-transformers", "load"),
        ("blockzoo.load(save_pretrained's directory)", "load-theirs", "load"),
        ("transformers from_pretrained(that directory)", "load-theirs-transformers", "load"),
        ("blockzoo.save(native checkpoint)", "save-blockzoo", "save native"),
        ("blockzoo.save(format='llama')", "save-blockzoo", "save hf"),
        ("blockzoo.save(format='llama', durable=False)", "save-blockzoo", "save hf unsynced"),
        ("transformers save_pretrained", "save-transformers", "save"),
        ("transformers save_pretrained + fsync", "save-transformers", "save synced"),
    ]
    best, best_cpu = {}, {}
    for label, kind, key in rows:
        times = figures[kind]["times"][key]
        best[label], best_cpu[label] = min(times), min(figures[kind]["cpu"][key])
        print(
            f"{label:<46} {times[0]:>8.2f} {min(times):>8.2f} {best_cpu[label]:>11.2f} "
            f"{figures[kind]['after_imports_mib']:>12.0f} {figures[kind]['peak_mib']:>9.0f}"
        )
    loads = [
        ("native checkpoint", "load-native", "load-transformers"),
        ("Hugging Face directory (blockzoo's export)", "load-hf", "load-transformers"),
        ("Hugging Face directory (save_pretrained's)", "load-theirs", "load-theirs-transformers"),
    ]
    for label, kind, peer in loads:
        ratio = min(figures[peer]["times"]["load"]) / min(figures[kind]["times"]["load"])
        print(
            f"load, {label}: time ratio (transformers / blockzoo) {ratio:.2f}, peak RSS ratio (blockzoo / "
            f"transformers) {figures[kind]['peak_mib'] / figures[peer]['peak_mib']:.2f}"
        )
    durable = ("blockzoo.save(native checkpoint)", "blockzoo.save(format='llama')")
    comparisons = [("transformers save_pretrained + fsync", label) for label in durable]
    comparisons += [
        ("transformers save_pretrained", label) for label in (*durable, "blockzoo.save(format='llama', durable=False)")
    ]
    for theirs_label, label in comparisons:
        print(
            f"save, {label}: time ratio ({theirs_label} / blockzoo) {best[theirs_label] / best[label]:.2f}, CPU "
            f"seconds ratio {best_cpu[theirs_label] / best_cpu[label]:.2f}"
        )
    print(
        "save peak RSS ratio (blockzoo / transformers, load + saves): "
        f"{figures['save-blockzoo']['peak_mib'] / figures['save-transformers']['peak_mib']:.2f}"
    )


if __name__ == "__main__":
    main()
