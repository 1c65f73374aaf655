"""`blockzoo prepare`: the command line of `blockzoo.data.prepare`. Imports nothing heavy until it runs."""

from __future__ import annotations

import argparse

FORMATS = ("text", "paragraphs", "jsonl")  # as in blockzoo.data.prepare, repeated so `--help` imports nothing


def register_data_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `blockzoo prepare` to the `blockzoo` command's subparsers."""
    parser = subparsers.add_parser(
        "prepare",
        help="tokenize text or JSONL files into a packed dataset (the memmap type)",
        description=(
            "Tokenize documents into PREFIX.bin (token ids), PREFIX.idx (document offsets) and PREFIX.json "
            "(metadata), the files a `data: {type: memmap, path: PREFIX}` config reads. Documents: with --format "
            "text, each file; with paragraphs, text separated by blank lines; with jsonl, the --field of each "
            "line's object. Documents with no text are skipped; the tokenizer's end-of-document token (the byte "
            "tokenizer's id 256) ends every document."
        ),
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="UTF-8 text or JSONL files")
    parser.add_argument("--output", "-o", required=True, metavar="PREFIX", help="path prefix of the files written")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|PATH",
        help="`byte` (UTF-8 bytes, 257 ids; the default) or a Hugging Face tokenizer.json (needs `tokenizers`)",
    )
    parser.add_argument("--format", choices=FORMATS, default="text", help="what a document is (default: text)")
    parser.add_argument("--field", metavar="NAME", help="the JSONL field holding the text (default: text)")
    parser.add_argument(
        "--eod-token", metavar="TOKEN", help="with a Hugging Face tokenizer: the token appended to every document"
    )
    parser.set_defaults(run=_prepare)


def _prepare(arguments: argparse.Namespace) -> int:
    from blockzoo.data.prepare import prepare
    from blockzoo.errors import UsageError

    if arguments.field is not None and arguments.format != "jsonl":
        raise UsageError("--field applies to --format jsonl only")
    summary = prepare(
        arguments.inputs,
        arguments.output,
        tokenizer=arguments.tokenizer,
        format=arguments.format,
        field=arguments.field or "text",
        eod_token=arguments.eod_token,
    )
    print(
        f"wrote {summary['num_documents']} documents, {summary['num_tokens']} tokens ({summary['dtype']}, "
        f"vocabulary {summary['vocab_size']}) to {arguments.output}.bin, .idx and .json"
    )
    return 0
