"""Every first-party layer resumes bit-exactly: the random states a run keeps (torch's generators
and every torch.Generator a module holds, the MoE router jitter's) are saved with its checkpoints and restored.
Cross-distribution (attention, mamba, mamba_2, discrete_mamba_2, mlp, moe): it runs in `tests(all)`; the checkpoint
reliability tests of the core alone are core/tests/test_checkpoint_reliability.py."""

import contextlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from blockzoo.config import load
from blockzoo.run_config import RunConfig
from blockzoo.training import random_state
from blockzoo.training.trainer import Trainer

BASE = {
    "model": {"hidden_size": 16, "embeddings": {"vocab_size": 257}},
    "distributed": {"backend": "gloo"},  # CPU, also where CUDA is present
    "data": {"type": "embedded", "sequence_length": 32, "micro_batch_size": 2, "num_documents": 4},
    "training": {"train_iters": 4, "optimizer": {"learning_rate": 0.01}, "schedule": {"decay": "constant"}},
}


def configure(output_dir: Path, *overrides: str) -> RunConfig:
    return load(RunConfig, data=BASE, overrides=[f"training.output_dir={output_dir}", *overrides])


def quiet(_: str) -> None:
    pass


HYBRID = {
    "type": "pattern",
    "blocks": {
        "a": {
            "mixer": {"type": "attention", "heads": 2, "head_size": 8},
            "mlp": {"type": "mlp", "intermediate_size": 32},
        },
        "m": {
            "mixer": {"type": "mamba"},
            "mlp": {"type": "moe", "experts": 4, "experts_per_token": 2, "intermediate_size": 16, "router_jitter": 0.2},
        },
        "m2": {"mixer": {"type": "mamba_2"}, "mlp": {"type": "none"}},
        "d": {"mixer": {"type": "discrete_mamba_2"}, "mlp": {"type": "none"}},
    },
    "pattern": ["a", "m", "m2", "d"],
}


def with_dropout(trainer: Trainer) -> Trainer:
    """Dropout on every block's output, drawn from torch's global generator (as a layer without a generator of its
    own draws)."""
    for block in trainer.model.decoder:
        block.register_forward_hook(lambda _, __, output: torch.nn.functional.dropout(output, 0.1, training=True))
    return trainer


class Interrupted(Exception):
    pass


def interrupt_after_a_checkpoint(message: str) -> None:
    if message.startswith("saved checkpoint"):
        raise Interrupted


def hybrid_run(root: Path, log=quiet) -> list[float]:
    """The hybrid's losses; with `log=interrupt_after_a_checkpoint`, those until the first checkpoint (step 2)."""
    config = configure(
        root,
        "model.hidden_size=32",
        f"model.decoder={json.dumps(HYBRID)}",
        "training.train_iters=4",
        "training.checkpoint_interval=2",
        "data.sequence_length=16",
    )
    trainer = with_dropout(Trainer(config, log=log))
    with contextlib.suppress(Interrupted):
        trainer.run()
    return [record.loss for record in trainer.history]


@pytest.mark.parametrize("restore", [True, False])
def test_every_first_party_layer_resumes_bit_exactly(tmp_path, monkeypatch, restore):
    straight = hybrid_run(tmp_path / "straight")
    if not restore:  # the control: without the random states, the resumed half differs
        monkeypatch.setattr("blockzoo.training.setup.restore_random_states", lambda *_: None)
    first = hybrid_run(tmp_path / "resumed", log=interrupt_after_a_checkpoint)
    messages = []
    second = hybrid_run(tmp_path / "resumed", log=messages.append)
    assert f"resumed from {tmp_path / 'resumed' / 'step_2'} (step 2)" in messages
    assert first == straight[:2]
    assert (first + second == straight) is restore


def test_random_states_are_every_generator_and_torchs(tmp_path):
    trainer = Trainer(configure(tmp_path, "model.hidden_size=32", f"model.decoder={json.dumps(HYBRID)}"), log=quiet)
    names = [name for name, _ in random_state.module_generators(trainer.model)]
    assert names == ["decoder.1.mlp._jitter_generator"]
    states = random_state.random_states(trainer.model, trainer.distributed)
    expected = torch.rand(3), torch.rand(3, generator=dict(random_state.module_generators(trainer.model))[names[0]])
    assert (
        random_state.restore_random_states(trainer.model, trainer.distributed, yaml.safe_load(yaml.safe_dump(states)))
        is None
    )
    generator = dict(random_state.module_generators(trainer.model))[names[0]]
    assert torch.equal(torch.rand(3), expected[0]) and torch.equal(torch.rand(3, generator=generator), expected[1])
    assert "2 ranks" in random_state.restore_random_states(trainer.model, trainer.distributed, states * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_random_states_on_a_gpu_round_trip_through_the_metadata(tmp_path):
    """The CUDA generator and the jitter generator (made on the GPU) are saved and restored."""
    config = configure(
        tmp_path, "model.hidden_size=32", f"model.decoder={json.dumps(HYBRID)}", "distributed.backend=nccl"
    )
    with Trainer(config, log=quiet) as trainer:
        (_, generator), *_ = random_state.module_generators(trainer.model)
        assert generator.device.type == "cuda"
        states = yaml.safe_load(yaml.safe_dump(random_state.random_states(trainer.model, trainer.distributed)))
        expected = torch.rand(5, device="cuda"), torch.rand(5, device="cuda", generator=generator)
        torch.rand(7, device="cuda"), torch.rand(7, device="cuda", generator=generator)  # the states move on
        assert random_state.restore_random_states(trainer.model, trainer.distributed, states) is None
        assert torch.equal(torch.rand(5, device="cuda"), expected[0])
        assert torch.equal(torch.rand(5, device="cuda", generator=generator), expected[1])
