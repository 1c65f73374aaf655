"""examples/mla.yaml (Mamba 2 blocks, then MLA blocks with a sigmoid-routed MoE) builds its blocks, trains on the CPU:
the example as written, shortened (fewer steps, shorter sequences), the loss falls and every MLA parameter moves; the
checkpoint reloads the trained model, and greedy generation through the latent cache equals greedy decoding by full
forwards. Needs blockzoo-mamba-2, blockzoo-mlp and blockzoo-moe (`[tool.blockzoo] test-with` in pyproject.toml)."""

from pathlib import Path

import pytest

import blockzoo
from blockzoo.config import read_yaml, structure
from blockzoo.run_config import RunConfig
from blockzoo_testing import (
    check_every_parameter_gets_a_gradient,
    check_trains_and_reloads,
    greedy_by_full_forward,
    shortened_example,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "mla.yaml"


def test_the_example_builds_its_blocks_and_every_parameter_gets_a_gradient(tmp_path):
    """The fast sibling of the training test: the example as written builds, and one backward reaches everything."""
    model = blockzoo.build(shortened_example(EXAMPLE, tmp_path))
    assert [type(block.mixer).__name__ for block in model.decoder] == ["Mamba2", "MultiHeadLatentAttention"] * 2
    # The MoE's score correction bias is frozen (not learned by gradients).
    check_every_parameter_gets_a_gradient(model, skip_frozen=True)


@pytest.mark.slow
def test_the_example_trains_on_cpu_and_reloads(tmp_path):
    run_config = shortened_example(EXAMPLE, tmp_path)
    check_trains_and_reloads(run_config, moved=lambda name: name.startswith("decoder.1.mixer."))


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
    assert model.generate(prompts, 5) == [greedy_by_full_forward(model, prompt, 5) for prompt in prompts]
