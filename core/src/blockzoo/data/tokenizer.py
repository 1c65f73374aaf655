"""Tokenizers: the built-in byte-level one, and `tokenizer.json` files (the `tokenizers` library's format) through the
optional `tokenizers` package (imported only when such a file is used). Torch-free.

The byte tokenizer maps text to its UTF-8 bytes (ids 0-255) and has one special token, id 256
(`<|endoftext|>`), that `blockzoo prepare` appends to every document; its vocabulary size is 257.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blockzoo.conversion import Origin, read_json
from blockzoo.data.errors import DatasetError

BYTE = "byte"
# The type a dataset's metadata records for a `tokenizer.json`: the name datasets have always been written with.
TOKENIZER_FILE = "huggingface"
EOD_TEXT = "<|endoftext|>"  # the byte tokenizer's end of a document, as text


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

    def hugging_face_files(self) -> dict[str, str]:
        """The files (name -> text) of an equivalent Hugging Face tokenizer, which `tokenizers` and Hugging Face's
        `AutoTokenizer` load and which encode text to the same ids: what an export to a Hugging Face format writes
        beside the weights when the model came with no tokenizer of its own."""
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

    def hugging_face_files(self) -> dict[str, str]:
        """A byte-level BPE without merges: each byte one token of id its value, as GPT-2's byte-level pre-tokenizer
        writes bytes as characters (`_byte_characters`), and `<|endoftext|>` the special token 256. One difference:
        that token's text inside a document is the special token there, where this tokenizer reads its 13 bytes."""
        vocabulary = {character: byte for byte, character in enumerate(_byte_characters())}
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        end = {"content": EOD_TEXT, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        tokenizer = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [{"id": self.eod_token_id, **end, "special": True}],
            "normalizer": None,
            "pre_tokenizer": byte_level,
            "post_processor": None,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False, "vocab": vocabulary,
                      "merges": []},
        }  # fmt: skip
        files = {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False)}
        return files | _end_of_document(EOD_TEXT, self.eod_token_id)


class FileTokenizer(Tokenizer):
    """A `tokenizer.json` (the `tokenizers` library's format). Encoding adds the special tokens its post-processor
    defines (a BOS token, for instance); `eod_token`, when given, names the token that ends each document."""

    def __init__(self, path: str | Path, eod_token: str | None = None):
        self.path = Path(path)
        self.eod_token = eod_token
        if not self.path.is_file():
            raise DatasetError(f"tokenizer file {self.path} does not exist")
        try:
            import tokenizers
        except ImportError:
            raise DatasetError(
                f"reading the tokenizer {self.path} needs the `tokenizers` package: pip install tokenizers"
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
        # `encode_batch_fast` (tokenizers >= 0.20) leaves out the character offsets: the same ids, measured 9% faster.
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        self._check_ids(ids)
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def to_metadata(self) -> dict[str, Any]:
        return {"type": TOKENIZER_FILE, "eod_token": self.eod_token}

    def hugging_face_files(self) -> dict[str, str]:
        text = self.path.read_text(encoding="utf-8")
        return {"tokenizer.json": text, **_end_of_document(self.eod_token, self.eod_token_id)}


HuggingFaceTokenizer = FileTokenizer  # its former name, which existing imports still use


def _end_of_document(token: str | None, token_id: int | None) -> dict[str, str]:
    """Hugging Face's `tokenizer_config.json` (the tokenizer.json as it is, with no model's class adding its own
    special tokens) and `generation_config.json`: the end-of-document token ends a sequence and a generation."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if token is None:
        return {"tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
    generation = {"eos_token_id": token_id}
    return {
        "tokenizer_config.json": json.dumps(config | {"eos_token": token}, indent=2) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }


def _byte_characters() -> list[str]:
    """The character GPT-2's byte-level pre-tokenizer writes for each byte: printable Latin-1 bytes stand for
    themselves, the others (controls, space, soft hyphen...) for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(others)) for byte in range(256)]


def load_tokenizer(spec: str | Path, *, eod_token: str | None = None) -> Tokenizer:
    """`"byte"`, or the path of a `tokenizer.json` (or of a directory holding one)."""
    if str(spec) == BYTE:
        if eod_token is not None:
            raise DatasetError(f"the byte tokenizer's end-of-document token is fixed; do not give one ({eod_token!r})")
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    return FileTokenizer(path, eod_token)


def origin_tokenizer(origin: Origin | None) -> tuple[Tokenizer, list[int]] | None:
    """The tokenizer of the Hugging Face checkpoint a model was imported from (its `tokenizer.json`), and the ids that
    end a generation (`eos_token_id` of its generation_config.json, else of its config.json); None without one."""
    if origin is None or "tokenizer.json" not in origin.files:
        return None
    tokenizer = FileTokenizer(origin.directory / "tokenizer.json")
    stop: Any = None
    for name in ("generation_config.json", "config.json"):
        if stop is None and name in origin.files:
            stop = read_json(origin.directory / name).get("eos_token_id")
    return tokenizer, [stop] if isinstance(stop, int) else list(stop or [])


def training_data_tokenizer(run_config: Any) -> Tokenizer | None:
    """The tokenizer of a run's training data (`run_config.data`), None when its data has none (random tokens) or
    cannot be read here (a prepared dataset's files elsewhere). Builds the dataset: imports torch."""
    from blockzoo.data.dataset import build_dataset

    data, model = run_config.data, run_config.model
    try:
        dataset = build_dataset(data, seed=run_config.distributed.seed, model_vocab_size=model.embeddings.vocab_size)
    except DatasetError:
        return None
    return dataset.tokenizer
