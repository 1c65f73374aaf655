"""LoRA through `apply_peft` on the first-party layers and a third-party plugin's: which linears get adapters (parents'
defaults, overrides, the parts of concatenated linears), that only adapters train (no gradient, no optimizer state
for the base; lr_scale and weight decay follow the linear), merge and unmerge against the adapters' forward, and the
refusal of a `peft` that adapts nothing. Against peft + transformers: converters/huggingface/tests/test_lora_peft.py."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import blockzoo
from blockzoo.checkpoint import CheckpointError, latest_checkpoint, record_checksum
from blockzoo.cli import main
from blockzoo.config import ConfigError, structure
from blockzoo.layers.base import Batch
from blockzoo.model.factory import base_reference, check_base
from blockzoo.peft.apply import adapters, merge_adapters, unmerge_adapters
from blockzoo.run_config import RunConfig
from blockzoo.training.config import AdamWConfig
from blockzoo.training.optimizer import AdamW
from blockzoo.training.trainer import Trainer
from blockzoo_lora.config import LoraConfig

VOCAB, LENGTHS = 64, [7, 5]
LORA = {"type": "lora", "rank": 3, "alpha": 6.0}
ATTENTION = {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8}
MLP = {"type": "mlp", "intermediate_size": 48, "gated": True}
MAMBA_2 = {"type": "mamba_2", "heads": 2, "head_size": 16, "state_size": 8, "chunk_size": 4}
SHORTCONV = {"type": "shortconv.gated_conv", "channels": 32, "kernel_size": 3}


def model_of(blocks: dict, peft: dict | None = LORA, seed: int = 5):
    pattern = list(blocks)
    decoder = {"type": "pattern", "pattern": pattern, "blocks": blocks}
    model = {"hidden_size": 32, "embeddings": {"vocab_size": VOCAB}, "decoder": decoder}
    if peft is not None:
        model["peft"] = peft
    return blockzoo.build({"model": model, "distributed": {"seed": seed}})


def randomize_adapters(model, seed: int = 1) -> None:
    """B starts at zeros: random, so that the adapters change the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, adapter in adapters(model):
            for b in adapter.lora_b.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.2)


def trainable(model) -> set[str]:
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(3))


def test_attention_adapts_query_and_value_by_default_and_mlp_nothing():
    model = model_of({"attn": {"mixer": ATTENTION, "mlp": MLP}})
    prefix = "decoder.0.mixer"
    assert trainable(model) == {
        f"{prefix}.query.adapter.lora_a.0",
        f"{prefix}.query.adapter.lora_b.0",
        f"{prefix}.key_value.adapter.lora_a.value",  # the value part of key‖value only, by its name
        f"{prefix}.key_value.adapter.lora_b.value",
    }
    adapter = model.decoder[0].mixer.key_value.adapter
    assert adapter.lora_a["value"].shape == (3, 32) and adapter.lora_b["value"].shape == (16, 3)  # 2 groups × 8


def test_a_checkpoint_with_adapters_named_by_index_still_loads(tmp_path):
    """Adapters of a fused linear once took their component's index (`key_value.adapter.lora_a.1`); a checkpoint
    written so loads into the named parameters (`lora_a.value`), with the same values."""
    mixer = {**ATTENTION, "key": {"apply_peft": True}}  # key and value of key‖value: names that replace 0 and 1
    model = model_of({"attn": {"mixer": mixer, "mlp": MLP}})
    randomize_adapters(model)
    blockzoo.save(model, tmp_path / "checkpoint")
    weights = tmp_path / "checkpoint" / "model.safetensors"
    tensors = load_file(weights)
    renamed = {"key": "0", "value": "1"}
    old = {
        re.sub(r"lora_([ab])\.(key|value)$", lambda m: f"lora_{m[1]}.{renamed[m[2]]}", n): t for n, t in tensors.items()
    }
    assert (
        "decoder.0.mixer.key_value.adapter.lora_a.1" in old
        and "decoder.0.mixer.key_value.adapter.lora_a.value" not in old
    )
    save_file(old, weights, metadata={"format": "pt"})
    record_checksum(tmp_path / "checkpoint", "model.safetensors")
    loaded = blockzoo.load(tmp_path / "checkpoint")
    expected = dict(model.named_parameters())
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter, expected[name]), name
    assert {"decoder.0.mixer.key_value.adapter.lora_b.key", "decoder.0.mixer.key_value.adapter.lora_b.value"} <= set(
        expected
    )


def test_any_linear_overrides_its_parents_default():
    mixer = {**ATTENTION, "query": {"apply_peft": False}, "key": {"apply_peft": True}, "value": {"apply_peft": False}}
    mlp = {**MLP, "up": {"apply_peft": True}, "down": {"apply_peft": True}}
    model = model_of({"attn": {"mixer": mixer, "mlp": mlp}})
    assert trainable(model) == {
        f"decoder.0.{name}.adapter.lora_{side}.{component}"
        for name, component in (("mixer.key_value", "key"), ("mlp.gate_up", "up"), ("mlp.down", 0))
        for side in "ab"
    }


def test_a_peft_that_adapts_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"model\.peft: no linear of the model has apply_peft enabled"):
        model_of({"ssm": {"mixer": MAMBA_2, "mlp": {"type": "none"}}})


def test_mamba_2_adapter_on_z_only_updates_the_z_rows():
    """in_proj = [z, x, B, C, dt]: with apply_peft on z alone, the update is scale·B A in z's rows, zeros elsewhere."""
    mixer = {**MAMBA_2, "z": {"apply_peft": True}, "out_proj": {"apply_peft": True}}
    model = model_of({"ssm": {"mixer": mixer, "mlp": {"type": "none"}}})
    randomize_adapters(model)
    in_proj = model.decoder[0].mixer.in_proj
    assert set(in_proj.adapter.lora_a) == {"z"} and model.decoder[0].mixer.out_proj.adapter is not None
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    z_rows = in_proj.output_dim.dims[0].global_size
    lora = in_proj.adapter
    expected = x @ in_proj.weight.T
    expected[:, :z_rows] += lora.scale * (x @ lora.lora_a["z"].T @ lora.lora_b["z"].T)
    torch.testing.assert_close(in_proj(x), expected, atol=1e-6, rtol=1e-5)


MOE = {"type": "moe", "experts": 4, "experts_per_token": 2, "intermediate_size": 16}


def test_moe_apply_peft_adapts_the_shared_experts_and_is_refused_without_them():
    """The routed experts' projections (one tensor of all experts) take no adapter: `apply_peft` on gate/up/down
    adapts the shared experts' projections only, and without shared experts it is refused by its field."""
    mlp = {**MOE, "shared_experts": 1, "up": {"apply_peft": True}, "down": {"apply_peft": True}}
    model = model_of({"moe": {"mixer": ATTENTION, "mlp": mlp}})
    adapted = {linear.name for linear, _ in adapters(model)}
    assert adapted == {
        f"decoder.0.{name}" for name in ("mixer.query", "mixer.key_value", "mlp.shared_gate_up", "mlp.shared_down")
    }
    assert set(model.decoder[0].mlp.shared_gate_up.adapter.lora_a) == {"shared_up"}  # up of gate‖up
    assert not any(parameter.requires_grad for parameter in model.decoder[0].mlp.gate_up.parameters())
    for part in ("up", "down", "gate"):
        with pytest.raises(ConfigError, match=rf"mlp\.{part}\.apply_peft: routed experts take no PEFT adapters"):
            model_of({"moe": {"mixer": ATTENTION, "mlp": {**MOE, part: {"apply_peft": True}}}})


def test_only_adapters_train_with_the_linears_lr_scale_and_weight_decay():
    mixer = {**ATTENTION, "query": {"lr_scale": 0.5, "weight": {"weight_decay": False}}}
    model = model_of({"attn": {"mixer": mixer, "mlp": MLP}})
    randomize_adapters(model)
    optimizer = AdamW(AdamWConfig(learning_rate=0.01, weight_decay=0.1), model.parameters())
    groups = {
        (group["lr"], group["weight_decay"]): {id(parameter) for parameter in group["params"]}
        for group in optimizer.param_groups
    }
    query, key_value = model.decoder[0].mixer.query.adapter, model.decoder[0].mixer.key_value.adapter
    assert groups == {
        (0.005, 0.0): {id(p) for p in query.parameters()},
        (0.01, 0.1): {id(p) for p in key_value.parameters()},
    }
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    loss, _ = model.loss(tokens(), tokens().roll(-1), Batch(LENGTHS))
    loss.backward()
    optimizer.step()
    for name, parameter in model.named_parameters():
        changed = not torch.equal(parameter, before[name])
        assert changed == (".adapter." in name), name
        assert (parameter in optimizer.state) == (".adapter." in name), name


def test_a_third_party_plugins_linears_take_adapters():
    """The example plugin's gated convolution: its fused input‖gate projection and its output, through their
    LinearConfig.apply_peft (the plugin's code knows nothing of PEFT); merging gives the adapters' logits."""
    mixer = {**SHORTCONV, "gate": {"apply_peft": True}, "output": {"apply_peft": True}}
    model = model_of({"conv": {"mixer": mixer, "mlp": MLP}})
    assert trainable(model) == {
        f"decoder.0.mixer.{name}.adapter.lora_{side}.{component}"
        for name, component in (("in_proj", "gate"), ("out_proj", 0))
        for side in "ab"
    }
    check_merge(model)


@pytest.mark.parametrize(
    "blocks",
    [
        {"attn": {"mixer": {**ATTENTION, "dense": {"apply_peft": True}}, "mlp": {**MLP, "gate": {"apply_peft": True}}}},
        {"ssm": {"mixer": {**MAMBA_2, "x": {"apply_peft": True}, "dt": {"apply_peft": True}}, "mlp": {"type": "none"}}},
    ],
    ids=["attention-mlp", "mamba_2"],
)
def test_merged_weights_give_the_adapters_logits(blocks):
    check_merge(model_of(blocks))


def check_merge(model) -> None:
    """Merged: the logits of the adapters (which then add nothing); unmerged: the original weights and logits back."""
    randomize_adapters(model)
    model.eval()
    batch = Batch(LENGTHS)
    with torch.no_grad():
        adapted = model.forward_packed(tokens(), batch)
        weights = {name: parameter.clone() for name, parameter in model.named_parameters()}
        base = copy.deepcopy(model)
        for _, adapter in adapters(base):
            for b in adapter.lora_b.values():
                b.zero_()
        assert not torch.allclose(base.forward_packed(tokens(), Batch(LENGTHS)), adapted, atol=1e-3)
        merge_adapters(model)
        changed = {name for name, parameter in model.named_parameters() if not torch.equal(parameter, weights[name])}
        assert changed == {f"{linear.name}.weight" for linear, _ in adapters(model)}
        torch.testing.assert_close(model.forward_packed(tokens(), Batch(LENGTHS)), adapted, atol=1e-5, rtol=1e-5)
        unmerge_adapters(model)
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(parameter, weights[name], atol=1e-6, rtol=0)
        torch.testing.assert_close(model.forward_packed(tokens(), Batch(LENGTHS)), adapted, atol=1e-5, rtol=1e-5)


def test_every_field_of_lora_changes_the_adapters_or_the_outputs():
    """rank: the adapters' shapes; alpha: the update's scale; dropout: the training forward (not the evaluation one)."""
    assert {field.name for field in attrs.fields(LoraConfig)} == {"rank", "alpha", "dropout"}
    blocks = {"attn": {"mixer": ATTENTION, "mlp": MLP}}

    def logits(peft: dict, train: bool = False) -> torch.Tensor:
        model = model_of(blocks, peft)
        randomize_adapters(model)
        model.train(train)
        torch.manual_seed(0)
        with torch.no_grad():
            return model.forward_packed(tokens(), Batch(LENGTHS))

    shapes = {p.shape for _, a in adapters(model_of(blocks, {**LORA, "rank": 5})) for p in a.parameters()}
    assert shapes == {torch.Size([5, 32]), torch.Size([32, 5]), torch.Size([16, 5])}
    assert not torch.allclose(logits(LORA), logits({**LORA, "alpha": 1.0}), atol=1e-4)
    dropped = {**LORA, "dropout": 0.5}
    assert not torch.allclose(logits(LORA, train=True), logits(dropped, train=True), atol=1e-4)
    torch.testing.assert_close(logits(LORA), logits(dropped), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("peft", "field"),
    [
        ({"type": "lora", "rank": 0}, "rank"),
        ({"type": "lora", "alpha": 0}, "alpha"),
        ({"type": "lora", "dropout": 1}, "dropout"),
    ],
)
def test_bad_lora_fields_are_refused_by_path(peft, field):
    with pytest.raises(ConfigError, match=rf"model\.peft\.{field}"):
        model_of({"attn": {"mixer": ATTENTION, "mlp": MLP}}, peft)


@pytest.mark.slow  # two training runs in fresh processes; test_only_adapters_train_... is its fast sibling
def test_the_memory_benchmark_counts_the_adapters_only(tmp_path):
    """benchmarks/lora_memory.py --tiny: LoRA trains the adapters of query ([8, 64], [64, 8]) and value ([8, 64],
    [32, 8]) in 2 blocks; full fine-tuning every parameter; gradients are 4 bytes per trainable parameter."""
    script = Path(__file__).parents[3] / "benchmarks" / "lora_memory.py"  # the repository's
    output = tmp_path / "results.json"
    subprocess.run([sys.executable, str(script), "--tiny", "--steps", "1", "--json", str(output)], check=True)
    full, lora = json.loads(output.read_text())
    adapters_per_block = 8 * 64 + 64 * 8 + 8 * 64 + 32 * 8
    assert lora["trainable"] == 2 * adapters_per_block == lora["parameters"] - full["parameters"]
    assert full["trainable"] == full["parameters"]
    for result in (full, lora):
        assert result["gradient_bytes"] == 4 * result["trainable"]
        assert result["optimizer_bytes"] >= 8 * result["trainable"]
    assert lora["optimizer_bytes"] < full["optimizer_bytes"] / 10


class Interrupted(Exception):
    pass


def _interrupt_after_a_checkpoint(message: str) -> None:
    if message.startswith("saved checkpoint"):
        raise Interrupted


def _lora_run_config(output_dir: Path, base: Path | None = None, **training) -> RunConfig:
    model = {
        "hidden_size": 32,
        "embeddings": {"vocab_size": 257},
        "decoder": {"num_blocks": 2, "block": {"mixer": ATTENTION, "mlp": MLP}},
        "peft": {**LORA, "dropout": 0.1},  # the dropout masks' random state is resumed too
    }
    if base is not None:  # the architecture comes from the base; the peft given is added to it
        model = {"pretrained": str(base), "peft": model["peft"]}
    data = {"type": "embedded", "num_documents": 8, "sequence_length": 32, "micro_batch_size": 2}
    training = {
        "train_iters": 4,
        "checkpoint_interval": 2,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup_iters": 1, "decay": "cosine"},
        "evaluation": {"interval": None},
        "output_dir": str(output_dir),
        **training,
    }
    return structure({"model": model, "data": data, "training": training}, RunConfig)


@pytest.fixture
def base_checkpoint(tmp_path) -> Path:
    """A native checkpoint of a model with random weights (no PEFT), the base of a LoRA run."""
    model = {
        "hidden_size": 32,
        "embeddings": {"vocab_size": 257},
        "decoder": {"num_blocks": 2, "block": {"mixer": ATTENTION, "mlp": MLP}},
    }
    blockzoo.save(blockzoo.build({"model": model, "distributed": {"seed": 9}}), tmp_path / "base")
    return tmp_path / "base"


@pytest.mark.parametrize("with_base", [True, False], ids=["adapters-only", "no-base"])
def test_a_lora_run_resumes_exactly(tmp_path, base_checkpoint, with_base):
    """Interrupted after its step-2 checkpoint and resumed: the losses of steps 3-4 and the final adapters (and
    base) of the straight run, bit for bit; the optimizer state holds the adapters only. With a `pretrained` base the
    checkpoints hold the adapters only (and a reference to the base); without one (fresh base weights) every weight."""
    base = base_checkpoint if with_base else None
    straight = Trainer(_lora_run_config(tmp_path / "straight", base), log=lambda _: None)
    straight.run()
    with pytest.raises(Interrupted):
        Trainer(_lora_run_config(tmp_path / "resumed", base), log=_interrupt_after_a_checkpoint).run()
    resumed = Trainer(_lora_run_config(tmp_path / "resumed", base), log=lambda _: None)
    second_half = resumed.run()
    assert [record.loss for record in second_half] == [record.loss for record in straight.history[2:]]
    expected = dict(straight.model.named_parameters())
    for name, parameter in resumed.model.named_parameters():
        assert torch.equal(parameter, expected[name]), name
    last = latest_checkpoint(tmp_path / "resumed")
    optimizer = load_file(last / "optimizer.safetensors")
    assert optimizer and all(".adapter." in name for name in optimizer)
    weights = load_file(last / "model.safetensors")
    adapter_names = {name for name in expected if ".adapter." in name}
    assert set(weights) == (adapter_names if with_base else set(expected))
    metadata = yaml.safe_load((last / "metadata.yaml").read_text())
    assert ("base" in metadata) == with_base
    loaded = blockzoo.load(last)  # the base's weights and the checkpoint's adapters
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter, expected[name]), name
    if with_base:
        assert metadata["base"]["path"] == str(base_checkpoint)
        base_weights = load_file(base_checkpoint / "model.safetensors")
        assert all(torch.equal(base_weights[name], expected[name]) for name in base_weights)


def test_a_lora_run_can_write_its_base_weights_too(tmp_path, base_checkpoint):
    """training.checkpoint_base_weights: every weight in the checkpoint, no `base` entry; it loads alone."""
    config = _lora_run_config(tmp_path / "run", base_checkpoint, train_iters=1, checkpoint_base_weights=True)
    trainer = Trainer(config, log=lambda _: None)
    trainer.run()
    last = latest_checkpoint(tmp_path / "run")
    assert set(load_file(last / "model.safetensors")) == set(dict(trainer.model.named_parameters()))
    assert "base" not in yaml.safe_load((last / "metadata.yaml").read_text())
    shutil.rmtree(base_checkpoint)
    loaded = blockzoo.load(last)
    expected = dict(trainer.model.named_parameters())
    assert all(torch.equal(parameter, expected[name]) for name, parameter in loaded.named_parameters())


def _changed_config(base: Path) -> None:
    """The base's config edited (hidden size), its checksum recorded anew, so only the base reference can tell."""
    config = yaml.safe_load((base / "config.yaml").read_text())
    config["model"]["decoder"]["block"]["mlp"]["intermediate_size"] = 40
    (base / "config.yaml").write_text(yaml.safe_dump(config))
    record_checksum(base, "config.yaml")


def _changed_weights(base: Path) -> None:
    model = blockzoo.load(base)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    shutil.rmtree(base)
    blockzoo.save(model, base)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (shutil.rmtree, "does not exist"),
        (_changed_weights, r"changed since the checkpoint was saved: model\.safetensors differs"),
        (_changed_config, r"model\.decoder\.block\.mlp\.intermediate_size was 48, is 40"),
    ],
    ids=["missing", "weights", "config"],
)
def test_a_changed_base_is_refused_by_resume_load_and_the_cli(tmp_path, base_checkpoint, capsys, change, message):
    config = _lora_run_config(tmp_path / "run", base_checkpoint, train_iters=2, checkpoint_interval=None)
    Trainer(config, log=lambda _: None).run()
    last = latest_checkpoint(tmp_path / "run")
    change(base_checkpoint)
    expected = rf"{base_checkpoint}: the base of {last} .*{message}"
    with pytest.raises(CheckpointError, match=expected):
        Trainer(_lora_run_config(tmp_path / "run", base_checkpoint, train_iters=4), log=lambda _: None)
    with pytest.raises(CheckpointError, match=expected):
        blockzoo.load(last)
    assert main(["convert", str(last), str(tmp_path / "merged"), "--merged"]) == 2
    error = capsys.readouterr().err
    assert re.search(expected, error) and "Traceback" not in error


def test_a_base_config_field_added_since_the_save_at_its_default_is_no_difference(base_checkpoint):
    """The base's model config is compared structured: a field the record lacks (as a newer blockzoo's would be)
    passes at its default; one whose default is not the base's value is a difference."""
    reference = base_reference(base_checkpoint)
    check_base("the checkpoint", reference)
    older = copy.deepcopy(reference)
    del older["model"]["embeddings"]["multiplier"]  # 1.0, the default
    check_base("the checkpoint", older)
    del older["model"]["decoder"]["block"]["mlp"]["intermediate_size"]  # 48, the default 4096
    with pytest.raises(CheckpointError, match=r"model\.decoder\.block\.mlp\.intermediate_size was 4096, is 48"):
        check_base("the checkpoint", older)


def test_a_base_recorded_with_sha256_checksums_is_still_checked(base_checkpoint):
    """A checkpoint saved before XXH3 records its base's weights by the chunked SHA-256: the base is hashed anew by
    that algorithm (hashlib's digests of the file's chunks, the reference), so an unchanged base passes and a changed
    one is refused."""
    import hashlib

    data = (base_checkpoint / "model.safetensors").read_bytes()
    chunks = b"".join(hashlib.sha256(data[start : start + 2**24]).digest() for start in range(0, len(data), 2**24))
    older = copy.deepcopy(base_reference(base_checkpoint))
    older["checksums"] = {
        "algorithm": "sha256-16MiB-chunks",
        "files": {"model.safetensors": hashlib.sha256(chunks).hexdigest()},
    }
    check_base("the checkpoint", older)
    _changed_weights(base_checkpoint)
    with pytest.raises(CheckpointError, match=r"model\.safetensors differs"):
        check_base("the checkpoint", older)
