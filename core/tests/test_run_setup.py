"""Setting a run up (`blockzoo.training.setup.prepare_run`) on its own, before any step: a new run, a resumed run
(its weights, optimizer state and data position read back against the checkpoint's files by the safetensors library
and YAML), the latest checkpoint looked up once, and a Trainer given the set-up training as one that made its own."""

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny_runs import configure as tiny_run

from blockzoo.run_config import RunConfig
from blockzoo.training.setup import RunSetup, prepare_run
from blockzoo.training.trainer import Trainer


def configure(output_dir: Path, *overrides: str) -> RunConfig:
    """The trainer tests' tiny run, evaluated every two steps."""
    return tiny_run(output_dir, "training.evaluation.interval=2", *overrides)


def test_a_new_run_is_set_up_at_step_zero_with_every_part(tmp_path):
    messages = []
    setup = prepare_run(configure(tmp_path), log=messages.append)
    try:
        assert isinstance(setup, RunSetup) and setup.owns_distributed
        assert setup.resumed_from is None and setup.step == 0 and setup.data_position is None and setup.base is None
        assert setup.pipeline is None and setup.harness is None
        parameters = {id(parameter) for parameter in setup.model.parameters()}
        optimized = {id(parameter) for group in setup.optimizer.param_groups for parameter in group["params"]}
        assert optimized == parameters == {id(parameter) for parameter in setup.trainable}
        assert not setup.optimizer.state  # no step taken
        assert (
            list(setup.evaluation_sets) == ["evaluation_loss"]
            and setup.evaluation_sets["evaluation_loss"] is setup.data
        )
        assert not any("resum" in message for message in messages)
    finally:
        setup.distributed.shutdown()


def test_a_resumed_run_is_set_up_from_the_latest_checkpoint_looked_up_once(tmp_path):
    config = configure(tmp_path, "training.checkpoint_interval=2", "training.checkpoint_keep=3")
    with Trainer(config, log=lambda _: None) as trainer:
        trainer.run()
    step_4 = tmp_path / "step_4"
    # A newer checkpoint that fails verification (its weights gone) is skipped, and said once.
    (tmp_path / "step_6").mkdir()
    for name in ("config.yaml", "metadata.yaml"):
        (tmp_path / "step_6" / name).write_bytes((step_4 / name).read_bytes())
    messages = []
    setup = prepare_run(configure(tmp_path, "training.train_iters=6"), log=messages.append)
    try:
        assert setup.resumed_from == step_4 and setup.step == 4
        assert sum(message.startswith(f"skipped checkpoint {tmp_path / 'step_6'}") for message in messages) == 1
        assert f"resumed from {step_4} (step 4)" in messages
        saved = load_file(step_4 / "model.safetensors")
        for name, parameter in setup.model.named_parameters():
            torch.testing.assert_close(parameter.detach(), saved[name], rtol=0, atol=0, msg=name)
        states = load_file(step_4 / "optimizer.safetensors")
        by_name = dict(setup.model.named_parameters())
        for key, tensor in states.items():
            name, _, state = key.partition("/")
            torch.testing.assert_close(setup.optimizer.state[by_name[name]][state], tensor, rtol=0, atol=0, msg=key)
        metadata = yaml.safe_load((step_4 / "metadata.yaml").read_text())
        assert setup.data_position == metadata["data"]
    finally:
        setup.distributed.shutdown()


@pytest.mark.parametrize("resumed", [False, True])
def test_a_trainer_given_a_setup_trains_as_one_that_makes_its_own(tmp_path, resumed):
    overrides = ["training.checkpoint_interval=2"]
    if resumed:
        for directory in ("own", "given"):
            first_half = configure(tmp_path / directory, "training.train_iters=2", *overrides)
            with Trainer(first_half, log=lambda _: None) as first:
                first.run()
    with Trainer(configure(tmp_path / "own", *overrides), log=lambda _: None) as own:
        expected = own.run()
    setup = prepare_run(configure(tmp_path / "given", *overrides), log=lambda _: None)
    with Trainer(setup=setup, log=lambda _: None) as given:
        assert given.step == (2 if resumed else 0)
        history = given.run()
    assert [(record.step, record.loss, record.gradient_norm) for record in history] == [
        (record.step, record.loss, record.gradient_norm) for record in expected
    ]
    assert len(history) == (2 if resumed else 4)
