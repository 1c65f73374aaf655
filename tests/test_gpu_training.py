"""bf16 training steps of the ~100M-parameter GPU example (examples/gpu.yaml) on one GPU."""

from pathlib import Path

import pytest
import torch

from blockzoo.config import load
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer

EXAMPLE = Path(__file__).parents[1] / "examples" / "gpu.yaml"


@pytest.mark.gpu
def test_the_gpu_example_trains_in_bf16(tmp_path):
    overrides = ["training.train_iters=30", "training.log_interval=10", f"training.output_dir={tmp_path}"]
    run_config = load(RunConfig, EXAMPLE, overrides)
    lines = []
    trainer = Trainer(run_config, log=lines.append)
    parameters = sum(p.numel() for p in set(trainer.model.parameters()))
    assert 90e6 < parameters < 110e6
    assert all(p.dtype == torch.float32 and p.is_cuda for p in trainer.model.parameters())  # fp32 master weights
    history = trainer.run()
    print("\n".join(lines))
    losses = [record.loss for record in history]
    assert all(torch.isfinite(torch.tensor(losses)))
    # Random tokens: the loss starts above ln(vocab) and falls towards it.
    assert losses[-1] < losses[0] - 0.15
    assert "MFU" in lines[-2] or "MFU" in lines[-1]
