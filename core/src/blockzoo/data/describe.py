"""`blockzoo data PREFIX`: what a prepared dataset holds, read through the `memmap` dataset's own checks."""

from __future__ import annotations

from pathlib import Path

from blockzoo.data.memmap import open_store
from blockzoo.data.storage import DatasetFiles, read_metadata, tokenizer_of
from blockzoo.data.tokenizer import TOKENIZER_FILE

_LISTED = 20  # sources and shards listed; a corpus of thousands of files is summed up


def describe(prefix: str | Path, *, samples: int = 3, characters: int = 300) -> str:
    """A report of the dataset at `prefix`: counts, tokenizer, shards, sources and the first `samples` documents
    decoded, each cut to `characters`. A missing or damaged dataset raises the memmap reader's DatasetError."""
    files = DatasetFiles(Path(prefix))
    metadata = read_metadata(files)
    store = open_store(files, metadata)
    tokenizer = tokenizer_of(files, metadata)
    documents, tokens = metadata["num_documents"], metadata["num_tokens"]
    described = metadata["tokenizer"]["type"]
    if described == TOKENIZER_FILE:
        described = f"Hugging Face {files.tokenizer}, end of document {metadata['tokenizer'].get('eod_token')!r}"
    lines = [
        f"dataset    {files.prefix} (format version {metadata['version']})",
        f"documents  {documents:,}",
        f"tokens     {tokens:,} ({tokens / documents:,.1f} per document)",
        f"tokenizer  {described}",
        f"vocabulary {metadata['vocab_size']:,} ids, end-of-document id {metadata['eod_token_id']}",
        f"dtype      {metadata['dtype']}",
        f"shards     {len(metadata['shards'])}",
    ]
    lines += [
        f"  {shard['name']}.bin/.idx: {shard['num_documents']:,} documents, {shard['num_tokens']:,} tokens"
        for shard in metadata["shards"][:_LISTED]
    ]
    if len(metadata["shards"]) > _LISTED:
        lines.append(f"  ... and {len(metadata['shards']) - _LISTED} more")
    sources = metadata.get("sources") or []
    lines.append(f"sources    {len(sources)}")
    lines += [f"  {source}" for source in sources[:_LISTED]]
    if len(sources) > _LISTED:
        lines.append(f"  ... and {len(sources) - _LISTED} more (all in {files.metadata})")
    offsets = store.offsets
    for number in range(min(samples, documents)):
        ids = store.tokens[int(offsets[number]) : int(offsets[number + 1])].tolist()
        text = tokenizer.decode(ids)
        shown = text if len(text) <= characters else text[:characters] + " [...]"
        lines.append(f"document {number} ({len(ids)} tokens): {shown!r}")
    return "\n".join(lines)
