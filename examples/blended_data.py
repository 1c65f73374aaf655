"""The data of examples/blended.yaml, made here without any download: three sources in three input formats, a
tokenizer trained on them, and `blockzoo prepare` run on each.

    python examples/blended_data.py            # writes data/blended/ (about 20 s)
    blockzoo train examples/blended.yaml

- web: stories of the embedded corpus, as Parquet files (a `text` column);
- code: generated Python-like functions, as compressed JSON lines (`.jsonl.zst`);
- math: generated arithmetic, as plain text (`paragraphs`: a document between blank lines); and `math_val`, more of
  it from another seed, prepared apart: a validation set used whole.
- tokenizer.json: a byte-level BPE of 1024 ids trained on all of it, `<|endoftext|>` ending every document.

Needs blockzoo-corpora (pyarrow, zstandard) and tokenizers: pip install blockzoo-corpora tokenizers.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

END_OF_DOCUMENT = "<|endoftext|>"
VERBS = ["compute", "count", "find", "scale", "filter", "merge", "clean", "sort", "total", "check"]
NOUNS = ["items", "values", "words", "scores", "names", "prices", "points", "lines", "rows", "tokens"]
OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def stories(count: int) -> list[str]:
    from blockzoo.data.corpus import stories as embedded_stories

    return list(embedded_stories(count))


def functions(count: int, seed: int) -> Iterator[str]:
    """Small Python functions over lists: a loop, a condition, an accumulator."""
    rng = random.Random(seed)
    for _ in range(count):
        verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
        item, limit = noun[:-1], rng.randint(1, 99)
        operator = rng.choice(["+", "*", "-"])
        start = "1" if operator == "*" else "0"
        condition = rng.choice([f"{item} > {limit}", f"{item} < {limit}", f"{item} % {rng.randint(2, 9)} == 0"])
        yield (
            f"def {verb}_{noun}({noun}):\n"
            f'    """{verb.capitalize()} the {noun} where {condition}."""\n'
            f"    result = {start}\n"
            f"    for {item} in {noun}:\n"
            f"        if {condition}:\n"
            f"            result = result {operator} {item}\n"
            f"    return result\n"
        )


def arithmetic(count: int, seed: int) -> Iterator[str]:
    """Paragraphs of correct equations of small numbers."""
    rng = random.Random(seed)
    for _ in range(count):
        lines = []
        for _ in range(rng.randint(3, 8)):
            a, b, symbol = rng.randint(0, 99), rng.randint(0, 99), rng.choice(list(OPERATORS))
            lines.append(f"{a} {symbol} {b} = {OPERATORS[symbol](a, b)}")
        yield "\n".join(lines)


def write_sources(raw: Path) -> dict[str, Path]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        import zstandard
    except ImportError as error:
        sys.exit(f"examples/blended_data.py needs pyarrow and zstandard ({error}): pip install blockzoo-corpora")
    web, code, math, math_val = (raw / name for name in ("web", "code", "math", "math_val"))
    for directory in (web, code, math, math_val):
        directory.mkdir(parents=True, exist_ok=True)
    texts = stories(6000)
    for part in range(3):  # a directory of Parquet files, as a corpus downloaded in shards would be
        pq.write_table(pa.table({"text": texts[part::3]}), web / f"part-{part:05d}.parquet")
    lines = "".join(json.dumps({"text": text}) + "\n" for text in functions(4000, seed=1))
    (code / "functions.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    (math / "equations.txt").write_text("\n\n".join(arithmetic(4000, seed=2)) + "\n")
    (math_val / "equations.txt").write_text("\n\n".join(arithmetic(200, seed=3)) + "\n")
    return {"web": web, "code": code, "math": math, "math_val": math_val}


def train_tokenizer(raw: Path, path: Path) -> None:
    """A byte-level BPE over every source (any text encodes: no unknown token)."""
    try:
        import pyarrow.parquet as pq
        import tokenizers
        import zstandard
    except ImportError as error:
        sys.exit(f"examples/blended_data.py needs tokenizers ({error}): pip install tokenizers")
    texts = [
        text for file in sorted((raw / "web").glob("*.parquet")) for text in pq.read_table(file)["text"].to_pylist()
    ]
    with zstandard.ZstdDecompressor().stream_reader((raw / "code" / "functions.jsonl.zst").open("rb")) as stream:
        texts += [json.loads(line)["text"] for line in io.TextIOWrapper(stream, encoding="utf-8")]
    texts += (raw / "math" / "equations.txt").read_text().split("\n\n")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=[END_OF_DOCUMENT],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(path))


def prepare(inputs: Path, output: Path, tokenizer: Path, *extra: str) -> None:
    command = [sys.executable, "-m", "blockzoo", "prepare", str(inputs), "--output", str(output)]
    command += ["--tokenizer", str(tokenizer), "--eod-token", END_OF_DOCUMENT, "--workers", "2", *extra]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/blended", help="where the sources go (default: data/blended)")
    output = Path(parser.parse_args().output)
    raw = output / "raw"
    sources = write_sources(raw)
    tokenizer = output / "tokenizer.json"
    train_tokenizer(raw, tokenizer)
    for name, inputs in sources.items():
        extra = ["--format", "paragraphs"] if name.startswith("math") else []
        prepare(inputs, output / name, tokenizer, *extra)
    print(f"prepared {', '.join(sources)} in {output}: now `blockzoo train examples/blended.yaml`")


if __name__ == "__main__":
    main()
