"""`blockzoo prepare` and `blockzoo data`: the command lines of `blockzoo.data.prepare` and `blockzoo.data.describe`.
Imports nothing heavy until they run."""

from __future__ import annotations

import argparse


def register_data_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `blockzoo prepare` and `blockzoo data` to the `blockzoo` command's subparsers."""
    parser = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus (Parquet, Arrow, saved `datasets`, JSONL, text) into a packed dataset (memmap type)",
        description=(
            "Tokenize documents into the dataset with path prefix PREFIX: PREFIX.json (metadata, written last: "
            "the dataset is complete once it exists) and the token and offset files of its shards (PREFIX.bin and "
            "PREFIX.idx, or PREFIX.00000.bin ... for a large corpus), what a `data: {type: memmap, path: PREFIX}` "
            "config reads. INPUT: files, directories (their recognised files, sorted) and globs (quote them). "
            "Formats (--format auto picks by name; `blockzoo plugins` lists the installed ones): jsonl (*.jsonl, "
            ".jsonl.gz), text (*.txt, *.md: a file is a document), paragraphs (text; documents between blank lines); "
            "with `pip install blockzoo-corpora`: parquet (*.parquet), arrow (*.arrow: Arrow IPC files and streams, "
            "`datasets` cache files), datasets (a directory of `save_to_disk`) and .zst files. Documents with no text "
            "are skipped; the tokenizer's end-of-document token (the byte tokenizer's id 256) ends every document. "
            "One worker or many write the same files; an interrupted run leaves no dataset that looks complete, "
            "and running it again starts afresh."
        ),
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or quoted globs")
    parser.add_argument("--output", "-o", required=True, metavar="PREFIX", help="path prefix of the files written")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|PATH",
        help="`byte` (UTF-8 bytes, 257 ids; the default) or a Hugging Face tokenizer.json (needs `tokenizers`)",
    )
    parser.add_argument(
        "--format", default="auto", metavar="NAME", help="the input format (default: auto, by file name)"
    )
    parser.add_argument(
        "--field", metavar="NAME", help="the column (Parquet, Arrow, datasets) or JSONL key of the text (default: text)"
    )
    parser.add_argument(
        "--eod-token", metavar="TOKEN", help="with a Hugging Face tokenizer: the token appended to every document"
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="processes tokenizing in parallel (default: the CPUs this process may use)",
    )
    parser.set_defaults(run=_prepare)

    inspect = subparsers.add_parser(
        "data",
        help="describe a prepared dataset: counts, tokenizer, shards, sources, sample documents",
        description=(
            "Print what a `data: {type: memmap, path: PREFIX}` run will read: documents, tokens, the tokenizer, "
            "token dtype, vocabulary, shards, the source files, and the first documents decoded (truncated)."
        ),
    )
    inspect.add_argument("prefix", metavar="PREFIX", help="the path prefix given to `blockzoo prepare --output`")
    inspect.add_argument("--samples", type=int, default=3, metavar="N", help="documents to show (default: 3)")
    inspect.add_argument(
        "--characters", type=int, default=300, metavar="N", help="characters shown of each document (default: 300)"
    )
    inspect.set_defaults(run=_describe)


def _prepare(arguments: argparse.Namespace) -> int:
    from blockzoo.data.prepare import prepare

    metadata = prepare(
        arguments.inputs,
        arguments.output,
        tokenizer=arguments.tokenizer,
        format=arguments.format,
        field=arguments.field or "text",
        eod_token=arguments.eod_token,
        workers=arguments.workers,
        progress=True,
    )
    shards = len(metadata["shards"])
    print(
        f"wrote {metadata['num_documents']} documents, {metadata['num_tokens']} tokens ({metadata['dtype']}, "
        f"vocabulary {metadata['vocab_size']}) in {shards} shard{'s' if shards > 1 else ''} to "
        f"{arguments.output} (.json, .bin, .idx)"
    )
    return 0


def _describe(arguments: argparse.Namespace) -> int:
    from blockzoo.data.describe import describe
    from blockzoo.errors import UsageError

    if arguments.samples < 0 or arguments.characters < 1:
        raise UsageError("--samples must be at least 0 and --characters at least 1")
    print(describe(arguments.prefix, samples=arguments.samples, characters=arguments.characters))
    return 0
