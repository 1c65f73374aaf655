"""Tokenizers: the built-in byte-level one, and Hugging Face `tokenizer.json` files through the optional
`tokenizers` package (imported only when such a file is used). Torch-free.

The byte tokenizer maps text to its UTF-8 bytes (ids 0-255) and has one special token, id 256
(`<|endoftext|>`), that `blockzoo prepare` appends to every document; its vocabulary size is 257.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blockzoo.conversion import Origin, read_json
from blockzoo.data.errors import DatasetError

BYTE = "byte"
HUGGING_FACE = "huggingface"


class Tokenizer:
    """Text to token ids and back. `eod_token_id` ends every document (None: documents are not marked)."""

    vocab_size: int
    eod_token_id: int | None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens left out."""
        raise NotImplementedError

    def to_metadata(self) -> dict[str, Any]:
        """What a dataset's metadata records to load this tokenizer again."""
        raise NotImplementedError

    def _check_ids(self, ids: Sequence[int]) -> None:
        if bad := [i for i in ids if not 0 <= i < self.vocab_size]:
            raise ValueError(f"token ids {bad[:5]} are outside this tokenizer's vocabulary [0, {self.vocab_size})")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0-255; id 256 is the end of a document."""

    vocab_size = 257
    eod_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        self._check_ids(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_metadata(self) -> dict[str, Any]:
        return {"type": BYTE}


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`. Encoding adds the special tokens its post-processor defines (a BOS
    token, for instance); `eod_token`, when given, names the token that ends each document."""

    def __init__(self, path: str | Path, eod_token: str | None = None):
        self.path = Path(path)
        self.eod_token = eod_token
        if not self.path.is_file():
            raise DatasetError(f"tokenizer file {self.path} does not exist")
        try:
            import tokenizers
        except ImportError:
            raise DatasetError(
                f"reading the Hugging Face tokenizer {self.path} needs the `tokenizers` package: pip install tokenizers"
            ) from None
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as error:  # noqa: BLE001 - the library raises plain Exceptions for malformed files
            raise DatasetError(f"cannot read the tokenizer {self.path}: {error}") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod_token_id = None
        if eod_token is not None:
            self.eod_token_id = self._tokenizer.token_to_id(eod_token)
            if self.eod_token_id is None:
                raise DatasetError(f"the end-of-document token {eod_token!r} is not in the vocabulary of {self.path}")

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        self._check_ids(ids)
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def to_metadata(self) -> dict[str, Any]:
        return {"type": HUGGING_FACE, "eod_token": self.eod_token}


def load_tokenizer(spec: str | Path, *, eod_token: str | None = None) -> Tokenizer:
    """`"byte"`, or the path of a Hugging Face `tokenizer.json` (or of a directory holding one)."""
    if str(spec) == BYTE:
        if eod_token is not None:
            raise DatasetError(f"the byte tokenizer's end-of-document token is fixed; do not give one ({eod_token!r})")
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    return HuggingFaceTokenizer(path, eod_token)


def origin_tokenizer(origin: Origin | None) -> tuple[Tokenizer, list[int]] | None:
    """The tokenizer of the Hugging Face checkpoint a model was imported from (its `tokenizer.json`), and the ids that
    end a generation (`eos_token_id` of its generation_config.json, else of its config.json); None without one."""
    if origin is None or "tokenizer.json" not in origin.files:
        return None
    tokenizer = HuggingFaceTokenizer(origin.directory / "tokenizer.json")
    stop: Any = None
    for name in ("generation_config.json", "config.json"):
        if stop is None and name in origin.files:
            stop = read_json(origin.directory / name).get("eos_token_id")
    return tokenizer, [stop] if isinstance(stop, int) else list(stop or [])
