"""The MoE example (examples/moe.yaml) trains: the loss falls and every layer's router losses are logged."""

from pathlib import Path

from blockzoo.config import load
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer

EXAMPLE = Path(__file__).parents[1] / "examples" / "moe.yaml"


def test_the_moe_example_trains(tmp_path):
    overrides = [
        "training.train_iters=12",
        "training.log_interval=4",
        "training.evaluation.interval=null",
        "training.schedule.warmup_iters=2",
        "data.sequence_length=64",
        "data.micro_batch_size=4",
        "distributed.backend=gloo",
        f"training.output_dir={tmp_path}",
    ]
    history = Trainer(load(RunConfig, EXAMPLE, overrides)).run()
    assert history[-1].loss < history[0].loss - 1.0
    names = set(history[-1].losses)
    assert names == {f"decoder.{i}.mlp.{loss}" for i in range(4) for loss in ("load_balancing", "router_z_loss")}
    # The load-balancing loss of a balanced router is its coefficient (0.01); it stays near it.
    assert all(0.005 < history[-1].losses[f"decoder.{i}.mlp.load_balancing"] < 0.05 for i in range(4))
