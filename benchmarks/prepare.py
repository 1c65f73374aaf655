"""Preparing a corpus: `blockzoo prepare` against `datasets` (load_dataset("parquet") + a batched `map` tokenizing
with the same `tokenizers` tokenizer, num_proc=2, writing its Arrow cache), on the CPU.

The corpus: `--megabytes` of deterministic generated English-like text (a Zipf-distributed lexicon of made-up
words over syllables, sentences of 4-24 words, documents of 2-40 sentences), written as `--shards` Parquet files
with a `text` column. The tokenizer: a `--vocabulary` (32k) BPE `tokenizer.json` trained here with `tokenizers` on
the first shard, with `<|endoftext|>` as the end-of-document token (both contenders append it to every document).

Each contender runs in a process of its own, started from a clean state (its own empty output or cache directory):
ours is `python -m blockzoo prepare DIR --tokenizer tokenizer.json --eod-token '<|endoftext|>'` with its default
workers (the usable CPUs); the peer loads the Parquet files with `datasets.load_dataset` (converting them to its
Arrow cache, part of its work) then maps the batched tokenization over `--peer-processes` processes. Measured:
wall seconds, tokens/s, CPU seconds (user + system of the contender and the workers it waited for: tokens per CPU
second does not depend on what else the machine runs, wall time does), and the peak of the process tree's memory:
the sum over the contender's process and all its descendants of their proportional set size (PSS,
/proc/PID/smaps_rollup: a page shared by k processes counts 1/k to each), sampled every 20 ms. Then the token ids
are checked equal: every document, in order, of our dataset (read through the memmap dataset's store) and of the
peer's Arrow cache files (read with pyarrow).

`--repeats N` runs each N times, alternated; the figures are the best time (wall and CPU) and the
highest peak of each.
Goal: ours >= 1.2x the peer's tokens/s at <= 0.5x its peak memory. `python benchmarks/prepare.py` (200 MB);
`--tiny` (2 MB, a 2k vocabulary: a check of the script, tests/test_benchmarks.py). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

EOD = "<|endoftext|>"
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]
PEER = """
import json, sys, os
os.environ["HF_DATASETS_OFFLINE"] = "1"
import datasets, tokenizers
datasets.disable_progress_bars()
files, cache, tokenizer_path, processes = json.loads(sys.argv[1])
tokenizer = tokenizers.Tokenizer.from_file(tokenizer_path)
eod = tokenizer.token_to_id("<|endoftext|>")

def tokenize(batch):
    return {"input_ids": [encoding.ids + [eod] for encoding in tokenizer.encode_batch(batch["text"])]}

dataset = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
tokenized = dataset.map(tokenize, batched=True, num_proc=processes, remove_columns=dataset.column_names)
print(json.dumps([entry["filename"] for entry in tokenized.cache_files]))
"""


def generate_corpus(directory: Path, megabytes: float, shards: int, seed: int = 20261205) -> list[Path]:
    """`shards` Parquet files of generated documents, about `megabytes` MB of UTF-8 text in all."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lexicon_size = 60_000
    lengths = rng.integers(1, 5, lexicon_size)
    pieces = rng.integers(0, len(SYLLABLES), (lexicon_size, 4))
    lexicon = np.array(["".join(SYLLABLES[p] for p in row[:n]) for row, n in zip(pieces, lengths, strict=True)])
    weights = 1.0 / np.arange(1, lexicon_size + 1) ** 1.1
    weights /= weights.sum()
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    per_shard = int(megabytes * 1e6 / shards)
    for shard in range(shards):
        documents: list[str] = []
        size = 0
        while size < per_shard:
            sentences = rng.integers(4, 25, rng.integers(2, 41))
            words = lexicon[rng.choice(lexicon_size, int(sentences.sum()), p=weights)]
            cuts = np.cumsum(sentences)[:-1]
            text = " ".join(" ".join(s).capitalize() + "." for s in np.split(words, cuts))
            documents.append(text)
            size += len(text) + 1
        path = directory / f"part-{shard:05d}.parquet"
        pq.write_table(pa.table({"text": documents}), path, row_group_size=4096)
        paths.append(path)
    return paths


def train_tokenizer(sample: Path, vocabulary: int, target: Path) -> None:
    import pyarrow.parquet as pq
    import tokenizers

    texts = pq.read_table(sample, columns=["text"]).column("text").to_pylist()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocabulary,
        special_tokens=[EOD],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(target))


# -- measuring a process tree ------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as file:
                found += [int(child) for child in file.read().split()]
    except OSError:
        pass
    return found


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            return next(int(line.split()[1]) for line in file if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def tree_pss_kib(root: int) -> int:
    """The summed PSS of a process and all its descendants."""
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        total += _pss_kib(pid)
        pending += _children(pid)
    return total


def run_measured(command: list[str], environment: dict[str, str] | None = None) -> dict:
    """Run a command; its wall seconds, the peak of its process tree's summed PSS, and its stdout."""
    cpu_before = _children_cpu_seconds()
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_pss_kib(process.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = process.communicate()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed ({process.returncode}):\n{stderr[-3000:]}")
    cpu = _children_cpu_seconds() - cpu_before
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_mib": peak / 1024, "stdout": stdout}


def _children_cpu_seconds() -> float:
    """User + system CPU time of the waited-for descendants (a contender and the workers it waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- the check ---------------------------------------------------------------------------------------------------------


def check_equal(prefix: Path, peer_files: list[str]) -> int:
    """The documents of our dataset and of the peer's Arrow files are the same token ids in the same order;
    returns the number of tokens."""
    import numpy as np
    import pyarrow as pa

    from blockzoo.data.memmap import open_store
    from blockzoo.data.storage import DatasetFiles, read_metadata

    files = DatasetFiles(prefix)
    store = open_store(files, read_metadata(files))
    offsets = store.offsets.numpy()
    document = 0
    for name in peer_files:
        with pa.ipc.open_stream(pa.OSFile(name)) as reader:
            for batch in reader:
                column = batch.column("input_ids")
                theirs_offsets = np.asarray(column.offsets) - column.offsets[0].as_py()
                count = len(column)
                ours_offsets = offsets[document : document + count + 1] - offsets[document]
                if not np.array_equal(theirs_offsets, ours_offsets):
                    raise AssertionError(f"document lengths differ among documents {document}..{document + count}")
                ours = store.tokens[int(offsets[document]) : int(offsets[document + count])].numpy()
                theirs = column.flatten().to_numpy()
                if not np.array_equal(ours.astype(np.int64), theirs.astype(np.int64)):
                    raise AssertionError(f"token ids differ among documents {document}..{document + count}")
                document += count
    if document != len(offsets) - 1:
        raise AssertionError(f"the peer holds {document} documents, ours {len(offsets) - 1}")
    return int(offsets[-1])


def versions() -> str:
    from importlib.metadata import version

    names = ("blockzoo", "datasets", "pyarrow", "tokenizers")
    return ", ".join(f"{name} {version(name)}" for name in names) + f", Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=200.0, help="text in the corpus (default 200)")
    parser.add_argument("--shards", type=int, default=16, help="Parquet files (default 16)")
    parser.add_argument("--vocabulary", type=int, default=32_000, help="BPE vocabulary (default 32000)")
    parser.add_argument("--peer-processes", type=int, default=2, help="datasets' num_proc (default 2)")
    parser.add_argument("--workers", type=int, help="ours: --workers (default: prepare's default, the usable CPUs)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, alternated: best time, worst peak")
    parser.add_argument("--directory", type=Path, help="where the corpus is made / reused (default: a temporary one)")
    parser.add_argument("--tiny", action="store_true", help="2 MB, 2 shards, a 2k vocabulary: a check of the script")
    parser.add_argument("--json", type=Path, help="also write the figures as one JSON object here")
    arguments = parser.parse_args()
    if arguments.tiny:
        arguments.megabytes, arguments.shards, arguments.vocabulary = 2.0, 2, 2_000
    temporary = None
    if arguments.directory is None:
        temporary = tempfile.mkdtemp(prefix="blockzoo-prepare-benchmark-")
        arguments.directory = Path(temporary)
    try:
        run(arguments)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def run(arguments: argparse.Namespace) -> None:
    root = arguments.directory
    corpus = root / f"corpus-{arguments.megabytes:g}mb-{arguments.shards}"
    if not corpus.is_dir():
        start = time.perf_counter()
        generate_corpus(corpus.with_suffix(".tmp"), arguments.megabytes, arguments.shards)
        corpus.with_suffix(".tmp").rename(corpus)
        print(f"generated {corpus} in {time.perf_counter() - start:.1f} s")
    files = sorted(str(path) for path in corpus.glob("*.parquet"))
    tokenizer = root / f"tokenizer-{arguments.vocabulary}.json"
    if not tokenizer.is_file():
        train_tokenizer(Path(files[0]), arguments.vocabulary, tokenizer)
    prefix = root / "ours" / "tokens"
    command = [sys.executable, "-m", "blockzoo", "prepare", str(corpus), "--tokenizer", str(tokenizer),
               "--eod-token", EOD, "--output", str(prefix)]  # fmt: skip
    if arguments.workers is not None:
        command += ["--workers", str(arguments.workers)]
    peer_arguments = json.dumps([files, str(root / "peer-cache"), str(tokenizer), arguments.peer_processes])
    peer_command = [sys.executable, "-c", PEER, peer_arguments]
    runs: dict[str, list[dict]] = {"ours": [], "peer": []}
    load_before = os.getloadavg()[0]
    for _ in range(arguments.repeats):  # alternated, so that a busy spell of the machine does not favour one
        for output in ("ours", "peer-cache"):
            shutil.rmtree(root / output, ignore_errors=True)
        runs["ours"].append(run_measured(command))
        runs["peer"].append(run_measured(peer_command, {**os.environ, "TQDM_DISABLE": "1"}))
    ours, peer = (
        {"seconds": min(run["seconds"] for run in runs[name]), "peak_mib": max(run["peak_mib"] for run in runs[name]),
         "cpu_seconds": min(run["cpu_seconds"] for run in runs[name]),
         "all_seconds": [round(run["seconds"], 1) for run in runs[name]], "stdout": runs[name][-1]["stdout"]}
        for name in ("ours", "peer")
    )  # fmt: skip
    tokens = check_equal(prefix, json.loads(peer["stdout"].strip().splitlines()[-1]))
    size = sum(Path(file).stat().st_size for file in files)
    print(f"corpus: {arguments.megabytes:g} MB of text in {len(files)} Parquet files ({size / 1e6:.1f} MB), "
          f"{tokens:,} tokens (a {arguments.vocabulary} BPE); {os.cpu_count()} CPUs; {versions()}")  # fmt: skip
    print("token ids: the same documents, the same ids (ours read through the memmap store, the peer's Arrow cache)")
    print(f"best of {arguments.repeats} runs each (seconds of every run: ours {ours['all_seconds']}, peer "
          f"{peer['all_seconds']}); peak: the highest; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")  # fmt: skip
    print(f"{'contender':<40} {'seconds':>8} {'tokens/s':>12} {'CPU s':>8} {'tokens/CPU s':>13} {'peak MiB':>9}")
    rows = {"ours (blockzoo prepare)": ours, f"datasets map (num_proc={arguments.peer_processes})": peer}
    for name, figures in rows.items():
        rate, cpu_rate = tokens / figures["seconds"], tokens / figures["cpu_seconds"]
        print(f"{name:<40} {figures['seconds']:>8.2f} {rate:>12,.0f} {figures['cpu_seconds']:>8.1f} "
              f"{cpu_rate:>13,.0f} {figures['peak_mib']:>9.0f}")  # fmt: skip
    speed, memory = peer["seconds"] / ours["seconds"], ours["peak_mib"] / peer["peak_mib"]
    print(f"ours / peer: {speed:.2f}x the tokens/s (goal >= 1.2), {memory:.2f}x the peak memory (goal <= 0.5), "
          f"{peer['cpu_seconds'] / ours['cpu_seconds']:.2f}x the tokens per CPU second")  # fmt: skip
    if arguments.json:
        record = {"tokens": tokens, "ours": ours, "peer": peer, "speed_ratio": speed, "memory_ratio": memory}
        for figures in (ours, peer):
            figures.pop("stdout")
        arguments.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
