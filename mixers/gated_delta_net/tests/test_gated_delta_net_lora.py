"""LoRA through `apply_peft` on the Gated DeltaNet's linears: with apply_peft on v alone, in_proj's adapter updates
v's rows only (the other components' rows are the base weight's), out_proj takes one too, and only the adapters
train."""

import torch

import blockzoo
from blockzoo.peft.apply import adapters

MIXER = {"type": "gated_delta_net", "key_heads": 2, "value_heads": 4, "key_head_size": 4, "value_head_size": 4}


def test_an_adapter_on_v_updates_only_the_v_rows():
    mixer = {**MIXER, "v": {"apply_peft": True}, "out_proj": {"apply_peft": True}}
    decoder = {"type": "pattern", "pattern": ["gdn"], "blocks": {"gdn": {"mixer": mixer, "mlp": {"type": "none"}}}}
    model = {"hidden_size": 32, "embeddings": {"vocab_size": 64}, "decoder": decoder}
    model = blockzoo.build({"model": {**model, "peft": {"type": "lora", "rank": 3}}, "distributed": {"seed": 5}})
    layer = model.decoder[0].mixer
    assert {linear.name for linear, _ in adapters(model)} == {"decoder.0.mixer.in_proj", "decoder.0.mixer.out_proj"}
    assert {name for name, p in model.named_parameters() if p.requires_grad} == {
        name for name, _ in model.named_parameters() if "lora" in name
    }
    in_proj, generator = layer.in_proj, torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in in_proj.adapter.lora_b.values():  # B starts at zeros: random, so that the adapter changes something
            b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
    x = torch.randn(5, 32, generator=generator)
    rows = [dim.global_size for dim in in_proj.output_dim.dims]  # q, k, v, z, b, a
    start, stop = sum(rows[:2]), sum(rows[:3])
    lora = in_proj.adapter
    assert set(lora.lora_a) == {"v"}  # the third component
    expected = x @ in_proj.weight.T
    expected[:, start:stop] += lora.scale * (x @ lora.lora_a["v"].T @ lora.lora_b["v"].T)
    torch.testing.assert_close(in_proj(x), expected, atol=1e-6, rtol=1e-5)
