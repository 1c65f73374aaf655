"""`blockzoo evaluate` through the real command: a results table and the results file, its metrics those of lm-eval's
own Hugging Face backend on the same exported model; a bad task, a missing plugin, lm-eval missing and a bad
checkpoint each end in one clear message and exit code 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import lm_eval.evaluator
from lm_eval.models.huggingface import HFLM
from lm_eval_tasks import GENERATION_TASK, MC_TASK, PERPLEXITY_TASK

from blockzoo.benchmarks.run import results_table
from blockzoo_lm_eval.benchmark import flat_metrics, task_manager

USAGE_ERROR = 2
TASKS = [MC_TASK, GENERATION_TASK, PERPLEXITY_TASK]


def blockzoo(*arguments, code: str | None = None, **environment) -> subprocess.CompletedProcess:
    command = ["-c", code] if code else ["-m", "blockzoo"]
    return subprocess.run(
        [sys.executable, *command, *map(str, arguments)],
        capture_output=True,
        text=True,
        env={**os.environ, "BLOCKZOO_STRICT_PLUGINS": "1", **environment},
        timeout=300,
    )


def test_evaluate_prints_and_writes_what_lm_evals_huggingface_backend_finds(transformer, task_dir, tmp_path):
    _, exported = transformer
    output = tmp_path / "results.json"
    arguments = ["--tasks", ",".join(TASKS), "--include-path", task_dir, "--limit", 4, "--output", output]
    result = blockzoo("evaluate", exported, *arguments)
    assert result.returncode == 0, result.stderr
    report = json.loads(output.read_text())
    assert sorted(report["results"]) == sorted(TASKS)
    ours = flat_metrics(report)
    assert results_table(ours) in result.stdout

    theirs = lm_eval.evaluator.simple_evaluate(
        model=HFLM(pretrained=str(exported), batch_size=1, device="cpu", dtype="float32"),
        tasks=TASKS,
        limit=4,
        task_manager=task_manager(TASKS, [str(task_dir)]),
        bootstrap_iters=0,
    )
    expected = flat_metrics(theirs)
    assert ours.keys() == expected.keys()
    assert ours[f"harness/{MC_TASK}/sample_len"] == 4
    for name, value in expected.items():
        assert math.isclose(ours[name], value, rel_tol=1e-4), (name, ours[name], value)


def test_an_unknown_task_is_refused_with_the_closest_names(transformer, task_dir):
    _, exported = transformer
    result = blockzoo("evaluate", exported, "--tasks", "blockzoo_test_mcq", "--include-path", task_dir)
    assert result.returncode == USAGE_ERROR
    assert "unknown lm-eval task 'blockzoo_test_mcq' (did you mean 'blockzoo_test_mc'" in result.stderr
    assert "Traceback" not in result.stderr


def test_without_the_plugin_the_error_says_what_to_install(transformer):
    _, exported = transformer
    result = blockzoo("evaluate", exported, "--tasks", MC_TASK, BLOCKZOO_DISABLE_PLUGINS="lm_eval")
    assert result.returncode == USAGE_ERROR
    assert "unknown benchmark type 'lm_eval'" in result.stderr
    assert "lm_eval" in result.stderr and "disabled" in result.stderr
    assert "Traceback" not in result.stderr


def test_without_lm_eval_the_error_says_how_to_install_it(transformer):
    _, exported = transformer
    hide = "import sys; sys.modules['lm_eval'] = None; from blockzoo.cli import main; sys.exit(main(sys.argv[1:]))"
    result = blockzoo("evaluate", exported, "--tasks", MC_TASK, code=hide)
    assert result.returncode == USAGE_ERROR
    assert "needs lm-evaluation-harness, which is not installed" in result.stderr
    assert "pip install 'lm-eval>=0.4'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_checkpoint_is_refused(task_dir, tmp_path):
    result = blockzoo("evaluate", tmp_path / "nothing", "--tasks", MC_TASK, "--include-path", task_dir)
    assert result.returncode == USAGE_ERROR
    assert f"{tmp_path / 'nothing'}" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "evaluation.json").exists()


def test_only_layout_overrides_are_taken(transformer, task_dir):
    _, exported = transformer
    result = blockzoo("evaluate", exported, "model.hidden_size=8", "--tasks", MC_TASK, "--include-path", task_dir)
    assert result.returncode == USAGE_ERROR
    assert "distributed.* overrides only, got model" in result.stderr
