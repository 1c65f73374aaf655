"""LoRA against peft + transformers: a tiny Llama exported by our converter, fine-tuned with the same adapters on both
sides (peft's LoraConfig on q_proj/v_proj, the same A, B and scaling), gives the same logits and the same adapter
gradients; only the adapters train."""

from __future__ import annotations

import pytest
import torch
from format_checks import random_model
from hf_cases import _ATTENTION, TOKENS, hf_logits, load_hf, our_logits, transformers_model

import blockzoo
from blockzoo.cli import main
from blockzoo.model.factory import convert
from blockzoo.peft.apply import adapters

peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 12.0
TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
# Gradients (of order 0.1-1) sum over every token and logit, in a different order on each side.
GRADIENT_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
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
            for module, adapter, component in ((attention.q_proj, query, "0"), (attention.v_proj, key_value, "1")):
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
            (attention.v_proj, block.mixer.key_value.adapter, "1"),
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
