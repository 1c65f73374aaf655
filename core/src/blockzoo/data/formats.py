"""Input formats of `blockzoo prepare` as registered kinds, like every other type: `input_format` (how files of a
format are recognised, cut into pieces and read) and `input_compression` (how a compressed line file is opened).

The core registers the formats that need no library (`text`, `paragraphs`, `jsonl`, and `.gz`); Parquet, Arrow,
saved `datasets` directories and `.zst` come with blockzoo-corpora. A plugin registers a format from its
`register_components` hook: `register("parquet", ParquetFormatConfig, "blockzoo_corpora.columnar:ParquetFormat")`,
its config a subclass of `InputFormatConfig` (the format has no settings: the class only names the kind).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar

from blockzoo.config import PolymorphicConfig, configclass
from blockzoo.data.errors import DatasetError

if TYPE_CHECKING:
    from blockzoo.data.inputs import InputFile, Piece

Batch = tuple[list[str], int]  # documents, and the input bytes read for them (an estimate for columnar files)


class InputFormatConfig(PolymorphicConfig):
    """An input format of `blockzoo prepare` (registered kind `input_format`)."""

    kind: ClassVar[str] = "input_format"


class InputCompressionConfig(PolymorphicConfig):
    """A compression of line files (registered kind `input_compression`, named by the file ending without its
    dot: `gz`, `zst`); its implementation is a function `open(raw binary stream) -> decompressed binary stream`."""

    kind: ClassVar[str] = "input_compression"


@configclass
class TextFormatConfig(InputFormatConfig):
    """`text`: a file is a document."""


@configclass
class ParagraphsFormatConfig(InputFormatConfig):
    """`paragraphs`: text whose documents are separated by blank lines."""


@configclass
class JsonlFormatConfig(InputFormatConfig):
    """`jsonl`: one JSON object a line, its `--field` the document."""


@configclass
class GzipCompressionConfig(InputCompressionConfig):
    """`.gz` files (the standard library's gzip)."""


class InputFormat:
    """What a registered input format implements. `extensions`: the endings of its files (lower case);
    `auto`: whether `--format auto` picks it by those endings; `compressible`: whether a file of it may end in a
    registered compression's ending (`.jsonl.gz`)."""

    extensions: ClassVar[tuple[str, ...]] = ()
    auto: ClassVar[bool] = True
    compressible: ClassVar[bool] = False
    # Set by a format that reads directories, not files: what such a directory is, for messages.
    directory_only: ClassVar[str | None] = None

    def input_directory(self, path: Path, *, required: bool) -> InputFile | None:
        """The directory as one input of this format (a saved dataset), or None when it is not one (a plain
        directory, whose files are the inputs); `required` (the user chose this format): say why it is not one."""
        return None

    def pieces(self, file: InputFile) -> list[Piece]:
        """The file cut into pieces (see `inputs.plan_units`); by default all of it in one."""
        from blockzoo.data.inputs import Piece

        return [Piece(file, None, file.size)]

    def read(self, piece: Piece, field: str) -> Iterator[Batch]:
        """The documents of one piece in batches, each with the input bytes it covers."""
        raise NotImplementedError


def input_format(name: str) -> InputFormat:
    """The registered input format `name`, or a DatasetError naming the known ones and what to install."""
    from blockzoo.config import UnknownTypeError
    from blockzoo.plugins import get_registry
    from blockzoo.plugins.providers import install_hint

    registry = get_registry()
    try:
        implementation = registry.resolve("input_format", name).load_implementation()
    except UnknownTypeError as error:
        hint = install_hint("input_format", name)
        raise DatasetError(f"--format {name}: " + (f"the input format {name!r} is {hint}" if hint else
                                                   _without_kind(error))) from None  # fmt: skip
    return implementation()


def format_names() -> list[str]:
    from blockzoo.plugins import get_registry

    return get_registry().available("input_format")


def compression_names() -> list[str]:
    from blockzoo.plugins import get_registry

    return get_registry().available("input_compression")


def open_compressed(path: Path, raw: IO[bytes]) -> IO[bytes]:
    """`raw` (the file `path` opened in binary) decompressed by the compression its ending names."""
    from blockzoo.config import UnknownTypeError
    from blockzoo.plugins import get_registry

    name = path.suffix.lower().lstrip(".")
    try:
        opener = get_registry().resolve("input_compression", name).load_implementation()
    except UnknownTypeError as error:
        raise DatasetError(missing_provider(path) or f"reading {path}: {_without_kind(error)}") from None
    return opener(raw)


def missing_provider(path: Path) -> str | None:
    """For a file whose ending names a first-party format or compression that is not installed: what to install."""
    from blockzoo.plugins import get_registry
    from blockzoo.plugins.providers import install_hint

    name = path.suffix.lower().lstrip(".")
    registry = get_registry()
    for kind in ("input_format", "input_compression"):
        if name not in registry.available(kind) and (hint := install_hint(kind, name)):
            return f"reading {path} needs the {kind.replace('_', ' ')} {name!r}, {hint}"
    return None


def _without_kind(error: Exception) -> str:
    return (
        str(error)
        .replace("unknown input_format type", "unknown input format")
        .replace("unknown input_compression type", "unknown compression")
    )


def open_gzip(raw: IO[bytes]) -> IO[bytes]:
    import gzip

    return gzip.GzipFile(fileobj=raw, mode="rb")
