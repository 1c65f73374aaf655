"""The `parallel` block (attention ‖ Mamba 2 ‖ the example short convolution, Falcon-H1-style) against a plain
composition of its own parts by hand; against the decoder block when it has one mixer; in `fixed` and `pattern`
sequences; its parameter names, FLOPs, generation (token by token equals the full forward), slices (a micro-batch
run in chunks equals the whole), tensor parallelism (2 gloo ranks equal one process) and its config errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import blockzoo
from blockzoo.config import ConfigError, merge, structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch, slice_batch
from blockzoo.model.config import ModelConfig
from blockzoo.model.language_model import LanguageModel
from blockzoo.model.parallel_block import ParallelBlock
from blockzoo_testing.distributed import run_distributed

RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
ATTENTION = {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8}
MAMBA_2 = {"type": "mamba_2", "heads": 4, "head_size": 8, "groups": 2, "state_size": 8, "chunk_size": 8}
CONV = {"type": "shortconv.gated_conv", "channels": 32, "kernel_size": 3}
MLP = {"type": "mlp", "intermediate_size": 48, "gated": True}
PARALLEL = {
    "type": "parallel",
    "mixers": {"attention": ATTENTION, "ssm": MAMBA_2, "conv": CONV},
    "input_multipliers": {"attention": 0.5, "ssm": 1.5},
    "output_multipliers": {"attention": 2.0, "conv": 0.7},
    "residual_multiplier": 0.8,
    "mlp": MLP,
    "normalization": RANDOM_NORM,
}
PATTERN = {
    "type": "pattern",
    "blocks": {"hybrid": PARALLEL, "attention": {"mixer": ATTENTION, "mlp": MLP, "normalization": RANDOM_NORM}},
    "pattern": ["hybrid", "attention"],
    "num_blocks": 3,
}
FIXED = {"type": "fixed", "num_blocks": 2, "block": {**PARALLEL, "mlp": {"type": "none"}}}
LENGTHS = [7, 12, 5]
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def model_data(decoder: dict) -> dict:
    return {
        "hidden_size": 32,
        "embeddings": {"vocab_size": 64},
        "decoder": decoder,
        "head": {"normalization": RANDOM_NORM},
    }


def build(decoder: dict, seed: int = 5) -> LanguageModel:
    return blockzoo.build({"model": model_data(decoder), "distributed": {"seed": seed}}).eval()


def tokens_of(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (count,), generator=torch.Generator().manual_seed(seed))


def by_hand(model: LanguageModel, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The logits as the parallel block is defined, from its parts: mixers on the normalized input times their
    input multipliers, outputs times their output multipliers summed, times the residual multiplier, added; then
    the MLP (its output times the residual multiplier)."""
    config = model.config.decoder
    hidden = model.embeddings(tokens, batch)
    for block, (_, block_config) in zip(model.decoder, config.expanded_blocks(), strict=True):
        if not isinstance(block, ParallelBlock):
            hidden = block(hidden, batch)
            continue
        normalized = block.norm_1(hidden)
        branch = 0
        for name, mixer in block.mixers.items():
            inputs = normalized * block_config.input_multipliers.get(name, 1.0)
            branch = branch + mixer(inputs, batch) * block_config.output_multipliers.get(name, 1.0)
        hidden = hidden + branch * block_config.residual_multiplier
        if block.mlp is not None:
            hidden = hidden + block.mlp(block.norm_2(hidden), batch) * block_config.residual_multiplier
    return model.head(hidden)


@pytest.mark.parametrize("decoder", [PATTERN, FIXED], ids=["pattern", "fixed"])
def test_the_block_is_the_sum_of_its_scaled_mixers_then_the_mlp(decoder):
    model = build(decoder)
    batch = Batch(LENGTHS)
    tokens = tokens_of(batch.num_tokens)
    with torch.no_grad():
        torch.testing.assert_close(
            model.forward_packed(tokens, batch), by_hand(model, tokens, batch), rtol=1e-5, atol=1e-5
        )


def test_one_mixer_without_multipliers_is_the_decoder_block():
    decoder_block = {"mixer": MAMBA_2, "mlp": MLP, "normalization": RANDOM_NORM}
    parallel_block = {"type": "parallel", "mixers": {"ssm": MAMBA_2}, "mlp": MLP, "normalization": RANDOM_NORM}
    reference = build({"type": "fixed", "num_blocks": 2, "block": decoder_block})
    model = build({"type": "fixed", "num_blocks": 2, "block": parallel_block}, seed=9)
    weights = {name.replace(".mixer.", ".mixers.ssm."): value for name, value in reference.state_dict().items()}
    model.load_state_dict(weights)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))


def test_parameter_names_follow_the_mixer_names_and_survive_a_checkpoint(tmp_path):
    model = build(PATTERN)
    names = {name for name, _ in model.named_parameters()}
    assert {"decoder.0.norm_1.weight", "decoder.0.norm_2.weight", "decoder.0.mlp.down.weight"} <= names
    assert "decoder.0.mixers.attention.dense.weight" in names
    assert "decoder.0.mixers.ssm.out_proj.weight" in names
    assert any(name.startswith("decoder.0.mixers.conv.") for name in names)
    assert not any(name.startswith("decoder.0.mixer.") for name in names)
    blockzoo.save(model, tmp_path / "checkpoint")
    loaded = blockzoo.load(tmp_path / "checkpoint").eval()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_flops_are_the_sum_of_the_parts():
    model = build(PATTERN)
    batch = Batch(LENGTHS)
    block = model.decoder[0]
    parts = [*block.mixers.values(), block.mlp]
    expected = tuple(sum(part.flops(batch)[i] for part in parts) for i in (0, 1))
    assert block.flops(batch) == expected and expected[0] > 0


def check_generation(model: LanguageModel) -> None:
    """Two prompts, then six tokens each fed one at a time through every mixer's state: each step's logits are
    those of the full forward over the prompt and the tokens so far."""
    prompts = [tokens_of(5, seed=1), tokens_of(3, seed=2)]
    continuations = [tokens_of(6, seed=3), tokens_of(6, seed=4)]
    states = [block.new_state(2, 11, torch.device("cpu"), torch.float32) for block in model.decoder]
    lengths = torch.tensor([5, 3])
    with torch.no_grad():
        first = Batch(lengths, past_lengths=torch.zeros(2, dtype=torch.long))
        step_logits = [model.forward_packed(torch.cat(prompts), first, states)]
        for step in range(6):
            tokens = torch.stack([continuation[step] for continuation in continuations])
            step_logits.append(model.forward_packed(tokens, Batch([1, 1], past_lengths=lengths), states))
            lengths = lengths + 1
        for index, (prompt, continuation) in enumerate(zip(prompts, continuations)):
            full = model.forward_packed(torch.cat([prompt, continuation]), Batch([len(prompt) + 6]))
            start = sum(len(p) for p in prompts[:index])
            torch.testing.assert_close(step_logits[0][start : start + len(prompt)], full[: len(prompt)], **TOLERANCE)
            steps = torch.stack([logits[index] for logits in step_logits[1:]])
            torch.testing.assert_close(steps, full[len(prompt) :], **TOLERANCE)


def test_generating_token_by_token_equals_the_full_forward():
    model = build(PATTERN)
    states = model.decoder[0].new_state(2, 11, torch.device("cpu"), torch.float32)
    assert set(states) == {"attention", "ssm", "conv"}
    check_generation(model)


# Every other first-party mixer beside attention: its own state, its own parameters under `mixers.<name>`.
OTHER_MIXERS = {
    "mamba": {"type": "mamba", "state_size": 4, "inner_size": 64},
    "discrete_mamba_2": {"type": "discrete_mamba_2", "heads": 4, "head_size": 8, "state_size": 4, "chunk_size": 8},
    "gated_delta_net": {
        "type": "gated_delta_net",
        "key_heads": 2,
        "value_heads": 4,
        "key_head_size": 8,
        "value_head_size": 8,
        "chunk_size": 8,
    },
    "mla": {
        "type": "mla",
        "heads": 4,
        "key_value_rank": 16,
        "nope_head_size": 8,
        "rotary_head_size": 8,
        "value_head_size": 8,
    },
}


@pytest.mark.parametrize("name", OTHER_MIXERS)
def test_every_first_party_mixer_runs_beside_attention(name):
    block = {
        **PARALLEL,
        "mixers": {"attention": ATTENTION, name: OTHER_MIXERS[name]},
        "input_multipliers": {name: 1.5},
        "output_multipliers": {name: 0.5},
    }
    model = build({"type": "fixed", "num_blocks": 2, "block": block})
    assert any(parameter.startswith(f"decoder.1.mixers.{name}.") for parameter, _ in model.named_parameters())
    batch = Batch(LENGTHS)
    tokens = tokens_of(batch.num_tokens)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_packed(tokens, batch), by_hand(model, tokens, batch), **TOLERANCE)
    check_generation(model)


def test_a_micro_batch_run_in_slices_equals_the_whole():
    model = build(PATTERN)
    batch = Batch(LENGTHS)
    tokens = tokens_of(batch.num_tokens)
    labels = tokens_of(batch.num_tokens, seed=7)
    whole, _ = model.loss(tokens, labels, batch)
    slices = [slice_batch(LENGTHS, start, start + 8) for start in range(0, 24, 8)]
    sliced, _ = model.loss(tokens, labels, slices)
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mixers": {}}, r"mixers: must name at least one mixer"),
        ({"mixers": {"a": ATTENTION, "nothing": {"type": "none"}}}, r"mixers\.nothing: a parallel block's mixers"),
        ({"output_multipliers": {"ssm2": 2.0}}, r"output_multipliers\.ssm2: no mixer named 'ssm2'"),
        ({"input_multipliers": {"x": 2.0}}, r"input_multipliers\.x: no mixer named 'x'"),
    ],
)
def test_config_errors_name_the_field(change, message):
    block = {**PARALLEL, **change}
    with pytest.raises(ConfigError, match=message):
        structure(model_data({"type": "fixed", "num_blocks": 1, "block": block}), ModelConfig)


# Tensor parallelism: attention and Mamba 2 split their heads; each mixer reduces its own output.
TP_DECODER = merge(PATTERN, {"blocks": {"hybrid": {"mixers": {"conv": None}}}})
TP_DECODER["blocks"]["hybrid"]["mixers"] = {"attention": ATTENTION, "ssm": MAMBA_2}
TP_DECODER["blocks"]["hybrid"]["output_multipliers"] = {"attention": 2.0, "ssm": 0.6}


def _tensor_parallel_run(reference: dict) -> None:
    config = DistributedConfig(seed=5, backend="gloo", timeout=60, tensor_parallel=2)
    with Distributed(config) as distributed:
        model = LanguageModel(structure(model_data(TP_DECODER), ModelConfig), distributed)
        batch = Batch(LENGTHS)
        tokens, labels = tokens_of(batch.num_tokens), tokens_of(batch.num_tokens, seed=7)
        loss, _ = model.loss(tokens, labels, batch)
        loss.backward()
        distributed.reduce_replicated_gradients(model.parameters())  # as the trainer does
        torch.testing.assert_close(loss.detach(), reference["loss"], rtol=1e-5, atol=1e-6)
        group = distributed.tensor_group
        for name, parameter in model.named_parameters():
            gradient, expected = parameter.meta.local_to_global(parameter.grad, group), reference["gradients"][name]
            # fp32 sums in another order, of a loss summed over the tokens: relative to the gradient's scale.
            scale = float(expected.abs().max())
            torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-5 * scale, msg=name)
        with torch.no_grad():
            torch.testing.assert_close(model.forward_packed(tokens, batch), reference["logits"], rtol=1e-5, atol=1e-5)
        dist.barrier()


@pytest.mark.distributed
def test_tensor_parallel_equals_one_process():
    model = build(TP_DECODER).train()
    batch = Batch(LENGTHS)
    tokens, labels = tokens_of(batch.num_tokens), tokens_of(batch.num_tokens, seed=7)
    loss, _ = model.loss(tokens, labels, batch)
    loss.backward()
    with torch.no_grad():
        logits = model.forward_packed(tokens, batch)
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    run_distributed(2, _tensor_parallel_run, {"loss": loss.detach(), "gradients": gradients, "logits": logits})
