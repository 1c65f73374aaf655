"""LoRA against peft + transformers: a tiny Llama exported by our converter, fine-tuned with the same adapters on both
sides (peft's LoraConfig on q_proj/v_proj, the same A, B and scaling), gives the same logits and the same adapter
gradients; only the adapters train."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from format_checks import random_model
from hf_cases import _ATTENTION, CASES, TOKENS, hf_logits, load_hf, our_logits, transformers_model
from hf_cases_mamba2 import CASES as MAMBA2_CASES
from safetensors.torch import load_file

import blockzoo
from blockzoo.checkpoint import latest_checkpoint, read_checkpoint_metadata
from blockzoo.cli import main
from blockzoo.config import load as load_config
from blockzoo.conversion import ConversionError
from blockzoo.model.factory import convert
from blockzoo.peft.apply import adapters
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer
from blockzoo_huggingface.adapters import load_adapters, save_adapters

peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 12.0
TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
# Gradients (of order 0.1-1) sum over every token and logit, in a different order on each side.
GRADIENT_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
EXAMPLE = Path(__file__).parents[3] / "examples" / "lora.yaml"
LLAMA = {**_ATTENTION, "head_dim": 24, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def exported_llama(tmp_path_factory):
    """A Llama directory written by our converter from a blockzoo model with blockzoo's random weights."""
    source = tmp_path_factory.mktemp("transformers")
    transformers_model("LlamaConfig", LLAMA).save_pretrained(source)
    directory = tmp_path_factory.mktemp("exported")
    blockzoo.save(random_model(blockzoo.load(source).config, seed=3), directory, format="llama")
    return directory


def _ours(directory, dropout: float = 0.0):
    peft_config = {"type": "lora", "rank": RANK, "alpha": ALPHA, "dropout": dropout}
    model = blockzoo.build({"model": {"pretrained": str(directory), "peft": peft_config}})
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():  # B starts at zeros: random, so that the adapters change the logits
        for _, adapter in adapters(model):
            for b in adapter.lora_b.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    return model


def _theirs(directory, ours):
    """peft's model on transformers' Llama with our adapters' A and B."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(load_hf(directory), config)
    layers = model.base_model.model.model.layers
    with torch.no_grad():
        for index, block in enumerate(ours.decoder):
            query, key_value = block.mixer.query.adapter, block.mixer.key_value.adapter
            attention = layers[index].self_attn
            for module, adapter, component in ((attention.q_proj, query, "0"), (attention.v_proj, key_value, "value")):
                module.lora_A["default"].weight.copy_(adapter.lora_a[component])
                module.lora_B["default"].weight.copy_(adapter.lora_b[component])
                assert module.scaling["default"] == adapter.scale
    return model.eval()


def test_same_adapters_give_the_logits_and_gradients_of_peft(exported_llama):
    ours = _ours(exported_llama)
    theirs = _theirs(exported_llama, ours)
    weights = torch.randn(*TOKENS.shape, 128, generator=torch.Generator().manual_seed(2))
    ours.eval()
    our_logits = ours(TOKENS)
    their_logits = theirs(input_ids=TOKENS).logits
    torch.testing.assert_close(our_logits, their_logits, **TOLERANCE)
    # The adapters matter: without them the logits are far from these.
    base = load_hf(exported_llama)(input_ids=TOKENS).logits
    assert not torch.allclose(base, their_logits, atol=1e-2)

    (our_logits * weights).sum().backward()
    (their_logits * weights).sum().backward()
    layers = theirs.base_model.model.model.layers
    for index, block in enumerate(ours.decoder):
        attention = layers[index].self_attn
        for module, adapter, component in (
            (attention.q_proj, block.mixer.query.adapter, "0"),
            (attention.v_proj, block.mixer.key_value.adapter, "value"),
        ):
            torch.testing.assert_close(
                adapter.lora_a[component].grad, module.lora_A["default"].weight.grad, **GRADIENT_TOLERANCE
            )
            torch.testing.assert_close(
                adapter.lora_b[component].grad, module.lora_B["default"].weight.grad, **GRADIENT_TOLERANCE
            )
    trainable = {name for name, parameter in ours.named_parameters() if parameter.requires_grad}
    assert trainable == {name for name, parameter in ours.named_parameters() if ".adapter." in name}
    assert all(parameter.grad is None for parameter in ours.parameters() if not parameter.requires_grad)
    their_trainable = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    assert sum(p.numel() for p in ours.parameters() if p.requires_grad) == their_trainable


def test_a_fine_tuned_model_exports_with_its_adapters_merged(exported_llama, tmp_path, capsys):
    """save(format=llama) and convert of a LoRA checkpoint write the merged model, which transformers runs with our
    logits; `convert --merged` writes it natively without PEFT; the model saved keeps its adapters and weights."""
    ours = _ours(exported_llama)
    expected = our_logits(ours)
    weights = {name: parameter.clone() for name, parameter in ours.named_parameters()}
    blockzoo.save(ours, tmp_path / "saved", format="llama")
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "saved")), expected, **TOLERANCE)
    assert all(torch.equal(parameter, weights[name]) for name, parameter in ours.named_parameters())
    torch.testing.assert_close(our_logits(ours), expected, atol=0, rtol=0)

    blockzoo.save(ours, tmp_path / "native")
    reloaded = blockzoo.load(tmp_path / "native")  # the adapters round-trip
    assert reloaded.config.peft == ours.config.peft
    torch.testing.assert_close(our_logits(reloaded), expected, atol=0, rtol=0)
    convert(tmp_path / "native", tmp_path / "converted", format="llama")
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "converted")), expected, **TOLERANCE)

    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "merged"), "--merged"]) == 0
    merged = blockzoo.load(tmp_path / "merged")
    assert merged.config.peft is None and not any(".adapter." in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(our_logits(merged), expected, **TOLERANCE)
    assert main(["convert", str(tmp_path / "merged"), str(tmp_path / "again"), "--merged"]) == 2
    assert "no PEFT fine-tuning" in capsys.readouterr().err


def test_exported_adapters_load_in_peft_with_our_logits(exported_llama, tmp_path):
    ours = _ours(exported_llama)
    save_adapters(ours, tmp_path / "adapters", "llama", base_model=str(exported_llama))
    theirs = peft.PeftModel.from_pretrained(load_hf(exported_llama), tmp_path / "adapters").eval()
    torch.testing.assert_close(theirs(input_ids=TOKENS).logits, our_logits(ours), **TOLERANCE)


def _peft_adapters(directory, target_modules, tmp_path):
    """A PEFT checkpoint of random adapters (B too) saved by peft, and the peft model's logits."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=target_modules)
    model = peft.get_peft_model(load_hf(directory), config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        return tmp_path / "peft", model.eval()(input_ids=TOKENS).logits


def test_peft_adapters_import_with_peft_logits(exported_llama, tmp_path):
    """q_proj/v_proj (the defaults) and gate_proj/down_proj (given apply_peft): into our query, the value part of
    key‖value, the gate part of gate‖up and down."""
    directory, expected = _peft_adapters(exported_llama, ["q_proj", "v_proj", "gate_proj", "down_proj"], tmp_path)
    peft_config = {"type": "lora", "rank": RANK, "alpha": ALPHA}
    mlp = {"type": "mlp", "gated": True, "gate": {"apply_peft": True}, "down": {"apply_peft": True}}
    ours = blockzoo.build(
        {"model": {"pretrained": str(exported_llama), "peft": peft_config, "decoder": {"block": {"mlp": mlp}}}}
    )
    load_adapters(ours, directory, "llama")
    torch.testing.assert_close(our_logits(ours), expected, **TOLERANCE)


def test_peft_modules_that_do_not_map_are_refused_by_name(exported_llama, tmp_path):
    directory, _ = _peft_adapters(exported_llama, ["q_proj", "v_proj", "up_proj"], tmp_path)
    ours = _ours(exported_llama)  # no apply_peft on the MLP
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.mlp\.up_proj.*cannot be mapped"):
        load_adapters(ours, directory, "llama")
    directory, _ = _peft_adapters(exported_llama, ["q_proj"], tmp_path / "q")
    with pytest.raises(ConversionError, match=r"no adapter tensors for .*key_value\.value"):
        load_adapters(ours, directory, "llama")


@pytest.fixture(scope="module")
def mamba2_directory(tmp_path_factory):
    _, class_name, config = MAMBA2_CASES["mamba2"]
    directory = tmp_path_factory.mktemp("mamba2")
    transformers_model(class_name, config).save_pretrained(directory)
    return directory


def _mamba2(directory, components: tuple[str, ...]):
    mixer = {"type": "mamba_2", **{name: {"apply_peft": True} for name in components}}
    model = {"pretrained": str(directory), "peft": {"type": "lora", "rank": RANK, "alpha": ALPHA}}
    return blockzoo.build({"model": {**model, "decoder": {"block": {"mixer": mixer}}}})


def test_mamba2_in_proj_parts_export_as_one_peft_module_and_import_back(mamba2_directory, tmp_path):
    """Adapters on z and x of in_proj [z, x, B, C, dt] are one PEFT module of rank 2·r (exact: the sum of ours), which
    peft loads with our logits; a PEFT in_proj adapter imports into a model adapting every part of in_proj."""
    ours = _mamba2(mamba2_directory, ("z", "x"))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _, adapter in adapters(ours):
            for b in adapter.lora_b.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    save_adapters(ours, tmp_path / "adapters", "mamba2")
    theirs = peft.PeftModel.from_pretrained(load_hf(mamba2_directory), tmp_path / "adapters").eval()
    torch.testing.assert_close(theirs(input_ids=TOKENS).logits, our_logits(ours), **TOLERANCE)

    directory, expected = _peft_adapters(mamba2_directory, ["in_proj"], tmp_path)
    with pytest.raises(ConversionError, match=r"component b of 'decoder\.0\.mixer\.in_proj'"):
        load_adapters(_mamba2(mamba2_directory, ("z", "x")), directory, "mamba2")
    every_part = _mamba2(mamba2_directory, ("z", "x", "b", "c", "dt"))
    load_adapters(every_part, directory, "mamba2")
    torch.testing.assert_close(our_logits(every_part), expected, **TOLERANCE)


def test_the_lora_example_fine_tunes_a_llama_and_its_adapters_load_in_peft(tmp_path):
    """examples/lora.yaml, shortened, from a tiny Llama of the corpus's vocabulary: only the adapters move, the loss
    falls, the merged export and our adapters in peft give the fine-tuned model's logits."""
    base = tmp_path / "llama"
    transformers_model("LlamaConfig", {**LLAMA, "vocab_size": 257}).save_pretrained(base)
    overrides = [
        f"model.pretrained={base}",
        f"training.output_dir={tmp_path / 'run'}",
        "training.train_iters=6",
        "training.checkpoint_interval=6",
        "training.evaluation.interval=null",
        "training.optimizer.learning_rate=2.0e-2",
        "data.sequence_length=64",
        "data.micro_batch_size=2",
        "model.peft.dropout=0.0",
    ]
    run_config = load_config(RunConfig, EXAMPLE, overrides)
    trainer = Trainer(run_config, log=lambda _: None)
    trainer.run()
    losses = [record.loss for record in trainer.history]
    assert losses[-1] < losses[0], losses
    checkpoint = latest_checkpoint(tmp_path / "run")  # the adapters only, and the Hugging Face base it refers to
    assert all(".adapter." in name for name in load_file(checkpoint / "model.safetensors"))
    assert read_checkpoint_metadata(checkpoint)["base"]["format"] == "llama"
    tuned = blockzoo.load(tmp_path / "run")
    untouched = blockzoo.load(base)
    base_weights = dict(untouched.named_parameters())
    for name, parameter in tuned.named_parameters():
        if ".adapter." not in name:
            assert torch.equal(parameter, base_weights[name]), name
    expected = our_logits(tuned)
    assert not torch.allclose(expected, our_logits(untouched), atol=1e-3)
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "run" / "llama")), expected, **TOLERANCE)
    # The adapters alone, through the command: peft puts them on the base with the fine-tuned model's logits.
    command = [sys.executable, "-m", "blockzoo", "convert", str(tmp_path / "run"), str(tmp_path / "adapters")]
    subprocess.run([*command, "--format", "llama", "--adapters"], check=True, capture_output=True)
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        base
    )
    theirs = peft.PeftModel.from_pretrained(load_hf(base), tmp_path / "adapters").eval()
    torch.testing.assert_close(theirs(input_ids=TOKENS).logits, expected, **TOLERANCE)


def test_convert_adapters_refuses_what_has_no_adapters(exported_llama, tmp_path, capsys):
    """--adapters of a model without PEFT, of a Hugging Face directory, without a format: exit 2, said."""
    blockzoo.save(blockzoo.load(exported_llama), tmp_path / "plain")
    for source, format_options, message in (
        (tmp_path / "plain", ["--format", "llama"], "no PEFT fine-tuning"),
        (exported_llama, ["--format", "llama"], "no blockzoo checkpoint"),
        (tmp_path / "plain", [], "give it \\(--format"),
    ):
        assert main(["convert", str(source), str(tmp_path / "out"), *format_options, "--adapters"]) == 2
        assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("case", ["mistral", "qwen2", "mixtral", "qwen3_moe"])
def test_adapters_of_every_attention_format_load_in_peft(case, tmp_path):
    """Query and value adapters of each format's tiny model: exported, peft loads them onto the transformers model
    with our logits."""
    format_name, class_name, config = CASES[case]
    transformers_model(class_name, config).save_pretrained(tmp_path / "base")
    model = {"pretrained": str(tmp_path / "base"), "peft": {"type": "lora", "rank": RANK, "alpha": ALPHA}}
    ours = blockzoo.build({"model": model})
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _, adapter in adapters(ours):
            for b in adapter.lora_b.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    save_adapters(ours, tmp_path / "adapters", format_name)
    theirs = peft.PeftModel.from_pretrained(load_hf(tmp_path / "base"), tmp_path / "adapters").eval()
    torch.testing.assert_close(theirs(input_ids=TOKENS).logits, our_logits(ours), **TOLERANCE)
