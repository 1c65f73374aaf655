"""What a Hugging Face checkpoint holds besides its architecture and weights (tokenizer, generation settings, token
ids, maximum length) stays with a model imported from it and comes back in its exports: through a model in memory,
`blockzoo convert`, and a training run that starts from it, resumes and exports. `blockzoo generate` uses that
tokenizer and stops where transformers' own generation stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
from format_checks import read_config
from hf_cases import CASES, hf_model, transformers_model

import blockzoo
from blockzoo.cli import main
from blockzoo.config import structure
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer

WORDS = [f"w{index}" for index in range(3, 128)]
# Away from LlamaConfig's defaults (bos 1, eos 2, no pad, 2048 positions).
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
MAX_POSITIONS = 777


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of the model's 128 ids that starts every text with <s>."""
    vocabulary = {"<pad>": 0, "<s>": 1, "</s>": 2, **{word: index for index, word in enumerate(WORDS, start=3)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory) -> Path:
    """A tiny Llama with a tokenizer, token ids, a maximum length and generation settings of its own."""
    directory = tmp_path_factory.mktemp("llama")
    _, class_name, config = CASES["llama_llama3"]
    model = transformers_model(class_name, {**config, **TOKEN_IDS, "max_position_embeddings": MAX_POSITIONS})
    model.generation_config.eos_token_id = [2, 9]
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    (directory / "LICENSE").write_text("the license of the original weights\n")
    (directory / "README.md").write_text("the card of the original model: not carried\n")
    return directory


def _companions(directory: Path) -> dict[str, bytes]:
    skipped = ("config.json", "README.md")
    return {
        path.name: path.read_bytes()
        for path in directory.iterdir()
        if path.name not in skipped and "safetensors" not in path.name
    }


def _check_given_back(exported: Path, original: Path) -> None:
    companions = _companions(original)
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "LICENSE"} <= companions.keys()
    assert _companions(exported) == companions
    assert not (exported / "README.md").exists()
    config = read_config(exported)
    assert {key: config[key] for key in TOKEN_IDS} == TOKEN_IDS
    assert config["max_position_embeddings"] == MAX_POSITIONS
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer("w5 w77 w3").input_ids == [1, 5, 77, 3]
    assert transformers.GenerationConfig.from_pretrained(exported).eos_token_id == [2, 9]


def test_an_export_gives_back_what_the_import_kept(hf_directory, tmp_path):
    model = blockzoo.load(hf_directory)
    blockzoo.save(model, tmp_path / "saved", format="llama")
    _check_given_back(tmp_path / "saved", hf_directory)
    # Through a native checkpoint (its `origin/`), and straight from format to format.
    assert main(["convert", str(hf_directory), str(tmp_path / "native")]) == 0
    assert sorted(path.name for path in (tmp_path / "native" / "origin").iterdir()) == sorted(
        ["config.json", *_companions(hf_directory)]
    )
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "streamed"), "--format", "llama"]) == 0
    _check_given_back(tmp_path / "streamed", hf_directory)
    assert main(["convert", str(hf_directory), str(tmp_path / "direct"), "--format", "llama"]) == 0
    _check_given_back(tmp_path / "direct", hf_directory)


def test_a_model_built_in_blockzoo_exports_without_an_origin(hf_directory, tmp_path):
    model = blockzoo.build({"model": blockzoo.load(hf_directory).config})
    blockzoo.save(model, tmp_path / "hf", format="llama")
    assert sorted(path.name for path in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert "max_position_embeddings" not in read_config(tmp_path / "hf")


def _run_config(pretrained: Path, output_dir: Path, train_iters: int, export_dir: Path) -> RunConfig:
    """Every step checkpointed, only the last kept."""
    return structure(
        {
            "model": {"pretrained": str(pretrained)},
            "data": {"type": "random", "vocab_size": 128, "sequence_length": 16, "micro_batch_size": 2},
            "training": {
                "train_iters": train_iters,
                "checkpoint_interval": 1,
                "checkpoint_keep": 1,
                "output_dir": str(output_dir),
                "optimizer": {"learning_rate": 1e-3},
                "export_format": "llama",
                "export_dir": str(export_dir),
            },
        },
        RunConfig,
    )


def test_training_from_a_huggingface_checkpoint_exports_with_its_tokenizer(hf_directory, tmp_path):
    Trainer(_run_config(hf_directory, tmp_path / "run", 2, tmp_path / "first"), log=lambda _: None).run()
    _check_given_back(tmp_path / "first", hf_directory)
    assert (tmp_path / "run" / "step_2" / "origin" / "tokenizer.json").is_file()
    # Resumed, the origin comes from the checkpoint, and later checkpoints keep it.
    resumed = Trainer(_run_config(hf_directory, tmp_path / "run", 4, tmp_path / "second"), log=lambda _: None)
    assert resumed.model.origin.directory == tmp_path / "run" / "step_2" / "origin"
    resumed.run()
    assert resumed.model.origin.directory == tmp_path / "run" / "step_4" / "origin"
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["metrics.jsonl", "step_4"]
    _check_given_back(tmp_path / "second", hf_directory)


def test_generate_uses_the_tokenizer_and_stops_where_transformers_stops(hf_directory, capsys):
    prompt = "w5 w77 w3 w40"
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_directory, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_directory)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    free = hf.generate(input_ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, input_ids.shape[1] :]
    # Stop at the third new token: the generation config lists it beside </s>.
    stops = [2, int(free[2])]
    expected = hf.generate(input_ids, max_new_tokens=8, do_sample=False, eos_token_id=stops)[0, input_ids.shape[1] :]
    expected = expected[: next(index for index, token in enumerate(expected.tolist()) if token in stops) + 1]
    assert len(expected) <= 3
    config = json.loads((hf_directory / "generation_config.json").read_text())
    stopping = hf_directory.parent / "stopping"
    if not stopping.exists():
        stopping.mkdir()
        for path in hf_directory.iterdir():
            (stopping / path.name).write_bytes(path.read_bytes())
        (stopping / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": stops}))

    assert main(["generate", str(stopping), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    continuation = tokenizer.decode(expected, skip_special_tokens=True)
    assert capsys.readouterr().out == f"{prompt}{continuation}\n"


def test_generate_refuses_a_huggingface_checkpoint_without_a_tokenizer(tmp_path, capsys):
    hf_model("llama_llama3").save_pretrained(tmp_path / "bare")
    assert main(["generate", str(tmp_path / "bare"), "--prompt", "w5"]) == 2
    assert f"{tmp_path / 'bare'} has no tokenizer.json to encode the prompt with" in capsys.readouterr().err


def test_origin_files_that_are_gone_are_a_clear_error(hf_directory, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in hf_directory.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    model = blockzoo.load(copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(blockzoo.api.ConversionError, match=r"copy/tokenizer.json: gone, but the model's origin files"):
        blockzoo.save(model, tmp_path / "hf", format="llama")
    assert not (tmp_path / "hf").exists()
    torch.testing.assert_close(model(torch.tensor([[1, 5]])), blockzoo.load(hf_directory)(torch.tensor([[1, 5]])))
