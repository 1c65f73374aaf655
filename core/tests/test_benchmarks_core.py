"""The core's side of benchmarks, without any backend installed: the `benchmark` kind's config path and the error
naming the plugin to install, the results file and table, when a training run's
benchmark is due, and the logits of chosen rows only (what scoring continuations asks of the model)."""

from __future__ import annotations

import json

import pytest
import torch

import blockzoo
from blockzoo.benchmarks.base import BenchmarkConfig, BenchmarkResult
from blockzoo.benchmarks.run import HarnessRunner, results_table, write_report
from blockzoo.config import ConfigError, structure
from blockzoo.layers.base import Batch
from blockzoo.run_config import RunConfig


def test_a_harness_without_its_plugin_names_the_field_and_the_distribution(monkeypatch, blockzoo_registry):
    monkeypatch.setenv("BLOCKZOO_PLUGINS", "blockzoo")  # the core alone, whatever else is installed
    from blockzoo.plugins import reset_registry

    reset_registry()
    with pytest.raises(ConfigError) as error:
        structure({"training": {"evaluation": {"harness": {"tasks": ["hellaswag"], "interval": 10}}}}, RunConfig)
    message = str(error.value)
    assert "training.evaluation.harness" in message
    assert "unknown benchmark type 'lm_eval'" in message and "blockzoo-lm-eval" in message


def test_the_results_file_is_written_whole_and_the_table_aligned(tmp_path):
    result = BenchmarkResult(metrics={"harness/a/acc": 0.25, "harness/long_name/ppl": 1.5e7}, report={"results": {}})
    path = write_report(tmp_path / "evaluation" / "step_3.json", result)
    assert json.loads(path.read_text()) == {"results": {}}
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_3.json"]  # no .partial left
    assert results_table(result.metrics).splitlines() == [
        "harness/a/acc          0.2500",
        "harness/long_name/ppl  1.5e+07",
    ]


class _Config(BenchmarkConfig):  # not registered: `due` reads the interval only
    pass


@pytest.mark.parametrize(("interval", "due"), [(None, [5]), (2, [2, 4, 5]), (5, [5])])
def test_a_benchmark_is_due_at_its_interval_and_at_the_end(interval, due):
    runner = HarnessRunner.__new__(HarnessRunner)
    runner.config = _Config(interval=interval)
    assert [step for step in range(1, 6) if runner.due(step, last=step == 5)] == due


def test_logits_of_chosen_rows_are_those_rows_of_all_logits():
    config = {
        "hidden_size": 16,
        "embeddings": {"vocab_size": 50},
        "decoder": {"num_blocks": 1, "block": {"mixer": {"type": "none"}, "mlp": {"type": "none"}}},
    }
    model = blockzoo.build({"model": config})
    tokens = torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(0))
    batch = Batch([5, 7])
    rows = torch.tensor([4, 0, 11, 5])
    with torch.no_grad():
        torch.testing.assert_close(
            model.forward_packed(tokens, batch, rows=rows), model.forward_packed(tokens, batch)[rows], rtol=0, atol=0
        )
