"""Training reads the device once per log line: one transfer of the figures of the steps since the last one
(`blockzoo.training.step.to_host`), and nothing in between.

The CPU cannot see a host synchronization, so this test counts what would cause one on a GPU: every call, from
blockzoo's code (the core and the plugins), of a tensor method that brings a value back to the host (`item`,
`tolist`, `float(t)`, `int(t)`, `bool(t)`, `numpy`) on a floating-point or boolean tensor, while the trainer runs its
steps (the next step's data is read and placed within them; the final checkpoint, which reads the weights, aside).
Integer tensors are left out: the document lengths and token ids are host data by design (`Batch` computes on the
host and copies). The GPU tests (tests/test_gpu_training.py, tests/test_zero.py: `torch.cuda.set_sync_debug_mode
("error")`) see every synchronization, of any dtype.
"""

import sys

import pytest
import torch
from transformer_reference import SEED, attention, block, model_data

from blockzoo.config import structure
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy")
BIGRAM = {
    "hidden_size": 16,
    "embeddings": {"vocab_size": 64},
    "decoder": {"num_blocks": 1, "block": {"mixer": {"type": "none"}, "mlp": {"type": "none"}}},
}
HYBRID = model_data(
    decoder={
        "type": "pattern",
        "num_blocks": 2,
        "pattern": ["attn", "ssm"],
        "blocks": {
            "attn": {**block(attention()), "mlp": {"type": "moe", "experts": 4, "experts_per_token": 2}},
            "ssm": {
                "mixer": {"type": "mamba_2", "heads": 4, "head_size": 8, "state_size": 8, "chunk_size": 8},
                "mlp": {"type": "mlp", "intermediate_size": 48},
            },
        },
    }
)
STEPS = 4
# Reads the code makes on the CPU only: linear_cross_entropy's label check, an asynchronous device assertion on GPUs.
CPU_ONLY = {("__bool__", "blockzoo.layers.cross_entropy")}


def count_reads(monkeypatch) -> list[tuple[str, str]]:
    """(method, calling module) of each host read of a float or bool tensor from blockzoo's code, while `active`."""
    reads: list[tuple[str, str]] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            device_data = self.dtype.is_floating_point or self.dtype == torch.bool
            if count_reads.active and device_data and caller.startswith("blockzoo") and (_name, caller) not in CPU_ONLY:
                reads.append((_name, caller))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


count_reads.active = False


@pytest.mark.parametrize("log_interval", [1, 2])
@pytest.mark.parametrize("model", [BIGRAM, HYBRID], ids=["bigram", "hybrid"])
def test_training_reads_the_device_once_per_log_line(model, log_interval, monkeypatch, tmp_path):
    run = {
        "model": model,
        "distributed": {"seed": SEED, "backend": "gloo"},
        "data": {"type": "random", "sequence_length": 32, "micro_batch_size": 2, "max_document_length": 12},
        "training": {
            "train_iters": STEPS,
            "gradient_accumulation": 2,
            "log_interval": log_interval,
            "output_dir": str(tmp_path),
            "gradient_clipping": 0.5,
        },
    }
    trainer = Trainer(structure(run, RunConfig), log=lambda _: None)
    assert trainer.optimizer.skips_non_finite_on_device
    reads = count_reads(monkeypatch)
    save = trainer.save

    def unwatched_save():
        count_reads.active = False
        try:
            return save()
        finally:
            count_reads.active = True

    trainer.save = unwatched_save
    count_reads.active = True
    try:
        history = trainer.run()
    finally:
        count_reads.active = False
    assert [record.step for record in history] == list(range(1, STEPS + 1))
    assert reads == [("tolist", "blockzoo.training.step")] * (STEPS // log_interval)
    # The one read brought everything the steps report.
    assert all(record.losses for record in history) == (model is HYBRID)
