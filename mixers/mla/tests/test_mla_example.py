"""examples/mla.yaml (Mamba 2 blocks, then MLA blocks with a sigmoid-routed MoE) builds its blocks, trains on the CPU:
the example as written, shortened (fewer steps, shorter sequences), the loss falls and every MLA parameter moves; the
checkpoint reloads the trained model, and greedy generation through the latent cache equals greedy decoding by full
forwards. Needs blockzoo-mamba-2, blockzoo-mlp and blockzoo-moe (`[tool.blockzoo] test-with` in pyproject.toml)."""

from pathlib import Path

import pytest
import torch

import blockzoo
from blockzoo.config import read_yaml, structure
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "mla.yaml"


def _shortened(tmp_path: Path) -> RunConfig:
    data = read_yaml(EXAMPLE)
    data["data"].update(sequence_length=64, micro_batch_size=4)
    data["training"].update(train_iters=12, log_interval=4, output_dir=str(tmp_path), checkpoint_interval=12)
    del data["training"]["evaluation"]
    data["training"]["schedule"]["warmup_iters"] = 2
    data["training"]["optimizer"]["learning_rate"] = 1.0e-2
    return structure({**data, "distributed": {"seed": 7, "backend": "gloo"}}, RunConfig)


def test_the_example_builds_its_blocks_and_every_parameter_gets_a_gradient(tmp_path):
    """The fast sibling of the training test: the example as written builds, and one backward reaches everything."""
    model = blockzoo.build(_shortened(tmp_path))
    assert [type(block.mixer).__name__ for block in model.decoder] == ["Mamba2", "MultiHeadLatentAttention"] * 2
    tokens = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:  # the MoE's score correction bias: frozen (not learned by gradients)
            continue
        assert parameter.grad is not None and bool(parameter.grad.abs().sum() > 0), name


@pytest.mark.slow
def test_the_example_trains_on_cpu_and_reloads(tmp_path):
    run_config = _shortened(tmp_path)
    initial = dict(blockzoo.build(run_config).named_parameters())
    trainer = Trainer(run_config, log=lambda message: None)
    history = trainer.run()
    assert all(torch.isfinite(torch.tensor(record.loss)) for record in history)
    assert history[-1].loss < history[0].loss - 1.0, [record.loss for record in history]
    for name, parameter in trainer.model.named_parameters():
        if name.startswith("decoder.1.mixer."):
            assert not torch.equal(parameter.detach(), initial[name].detach()), name
    reloaded = blockzoo.load(tmp_path)
    tokens = torch.randint(0, 257, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens), trainer.model(tokens), atol=0, rtol=0)


def _greedy_by_full_forward(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("absorbed", [True, False])
def test_generation_through_the_latent_cache_equals_greedy_full_forwards(tmp_path, absorbed):
    # The example's blocks at small widths (random weights, float32): prompts of different lengths decoded token by
    # token, the MLA blocks through the latent cache, the Mamba 2 blocks through their state.
    data = read_yaml(EXAMPLE)
    data["model"]["hidden_size"] = 32
    blocks = data["model"]["decoder"]["blocks"]
    blocks["ssm"]["mixer"].update(heads=2, head_size=16, state_size=8, chunk_size=4)
    blocks["ssm"]["mlp"]["intermediate_size"] = 32
    sizes = {"query_rank": 16, "key_value_rank": 16, "nope_head_size": 8, "rotary_head_size": 8, "value_head_size": 4}
    blocks["mla"]["mixer"].update(heads=2, absorbed_decoding=absorbed, **sizes)
    blocks["mla"]["mlp"]["intermediate_size"] = 16
    model = blockzoo.build(structure({**data, "distributed": {"seed": 7, "backend": "gloo"}}, RunConfig))
    model.eval()
    prompts = [[3, 14, 15, 9, 2, 6], [5], [35, 8, 9]]
    assert model.generate(prompts, 5) == [_greedy_by_full_forward(model, prompt, 5) for prompt in prompts]
