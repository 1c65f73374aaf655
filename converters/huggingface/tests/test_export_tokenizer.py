"""A model that came with no tokenizer of its own leaves with its training data's: a byte-tokenized model exported to
Hugging Face writes a tokenizer.json that `tokenizers` and transformers' AutoTokenizer load and that encodes text to
the byte tokenizer's ids, so `blockzoo generate` of the export continues a prompt as the native checkpoint does."""

import subprocess
import sys

import pytest
import tokenizers
from transformers import AutoTokenizer, GenerationConfig

import blockzoo
from blockzoo.data.tokenizer import ByteTokenizer

TEXTS = ["Once upon a time", "Héllo wörld\n\tÿ 日本 \x00\x7f end", " leading and trailing spaces  "]
RUN = {
    "model": {
        "hidden_size": 32,
        "embeddings": {"vocab_size": 257},
        "decoder": {
            "num_blocks": 2,
            "block": {
                "mixer": {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8},
                "mlp": {"type": "mlp", "intermediate_size": 48, "gated": True},
            },
        },
    },
    "data": {"type": "embedded", "num_documents": 20, "sequence_length": 32},
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte")
    blockzoo.save(blockzoo.build(RUN), directory / "native")
    done = subprocess.run(
        [sys.executable, "-m", "blockzoo", "convert", directory / "native", directory / "llama", "--format", "llama"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return directory


def test_the_exported_tokenizer_encodes_as_the_byte_tokenizer(exported):
    by_bytes = ByteTokenizer()
    hugging_face = tokenizers.Tokenizer.from_file(str(exported / "llama" / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(exported / "llama")
    assert hugging_face.get_vocab_size() == by_bytes.vocab_size
    for text in TEXTS:
        ids = by_bytes.encode(text)
        assert hugging_face.encode(text).ids == ids
        assert auto(text).input_ids == ids
        assert hugging_face.decode(ids) == text
    assert auto.eos_token_id == by_bytes.eod_token_id
    assert GenerationConfig.from_pretrained(exported / "llama").eos_token_id == by_bytes.eod_token_id


def test_generate_continues_the_export_as_the_native_checkpoint(exported):
    outputs = []
    for checkpoint in ("native", "llama"):
        command = ["generate", exported / checkpoint, "--prompt", "Once", "--max-new-tokens", "8"]
        done = subprocess.run([sys.executable, "-m", "blockzoo", *command], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[0].startswith("Once")
