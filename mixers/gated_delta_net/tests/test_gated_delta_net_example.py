"""examples/gated_delta_net.yaml (Gated DeltaNet + attention blocks) builds the blocks it says and trains on the CPU:
the example as written, shortened (fewer steps, shorter sequences), the loss falls and every Gated DeltaNet
parameter moves; the checkpoint reloads the trained model. Needs blockzoo-attention and blockzoo-mlp
(`[tool.blockzoo] test-with` in pyproject.toml)."""

from pathlib import Path

import pytest

import blockzoo
from blockzoo_testing import check_every_parameter_gets_a_gradient, check_trains_and_reloads, shortened_example

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gated_delta_net.yaml"


def test_the_example_builds_its_blocks_and_every_parameter_gets_a_gradient(tmp_path):
    """The fast sibling of the training test: the example as written builds, and one backward reaches everything."""
    model = blockzoo.build(shortened_example(EXAMPLE, tmp_path))
    assert [type(block.mixer).__name__ for block in model.decoder] == ["GatedDeltaNet"] * 3 + ["Attention"]
    check_every_parameter_gets_a_gradient(model)


@pytest.mark.slow
def test_the_example_trains_on_cpu_and_reloads(tmp_path):
    run_config = shortened_example(EXAMPLE, tmp_path)
    check_trains_and_reloads(run_config, moved=lambda name: name.startswith("decoder.0.mixer."))
