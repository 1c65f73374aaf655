"""Benchmark type `lm_eval`: lm-evaluation-harness's `simple_evaluate` on the model in memory, through
`BlockzooLM`. Data-parallel ranks each score a share of the documents (lm-eval's own rank / world_size split, over
the data ranks); tensor- and pipeline-parallel ranks score the same ones; rank 0 gets the results."""

from __future__ import annotations

import difflib
import json
import random
from pathlib import Path
from typing import Any

from blockzoo.api import Benchmark, BenchmarkResult, UsageError
from blockzoo_lm_eval.config import LmEvalConfig

INSTALL = "pip install 'lm-eval>=0.4'"


def import_lm_eval() -> Any:
    """lm-evaluation-harness, or a `UsageError` saying how to install it."""
    try:
        import lm_eval
        import lm_eval.evaluator
    except ImportError as error:
        raise UsageError(
            f"benchmark type 'lm_eval' needs lm-evaluation-harness, which is not installed ({error}): {INSTALL} "
            "(or reinstall blockzoo-lm-eval with its dependencies: pip install 'blockzoo-lm-eval')"
        ) from None
    return lm_eval


class LmEvalBenchmark(Benchmark):
    def __init__(self, config: LmEvalConfig):
        super().__init__(config)
        import_lm_eval()
        self.task_manager = task_manager(config.tasks, config.task_paths)

    def evaluate(self, model: Any, tokenizer: Any, distributed: Any, *, stop_tokens: Any = ()) -> BenchmarkResult:
        import lm_eval.evaluator
        import numpy
        import torch
        from lm_eval.utils import handle_non_serializable

        from blockzoo_lm_eval.backend import BlockzooLM

        config = self.config
        lm = BlockzooLM(
            model,
            tokenizer,
            distributed,
            stop_tokens=stop_tokens,
            batch_size=config.batch_size,
            max_length=config.max_length,
        )
        limit = config.limit if config.limit is None or config.limit < 1 else int(config.limit)
        # lm-eval seeds the global generators; a training run's own draws must not change because it evaluated.
        states = random.getstate(), numpy.random.get_state(), torch.random.get_rng_state()
        try:
            results = lm_eval.evaluator.simple_evaluate(
                model=lm,
                tasks=list(config.tasks),
                num_fewshot=config.num_fewshot,
                limit=limit,
                bootstrap_iters=config.bootstrap_iters,
                task_manager=self.task_manager,
                log_samples=False,
                verbosity="WARNING",
            )
        finally:
            random.setstate(states[0])
            numpy.random.set_state(states[1])
            torch.random.set_rng_state(states[2])
        if results is None:  # a data rank other than the first: rank 0's results are shared by the caller
            return BenchmarkResult(metrics={}, report={})
        report = json.loads(json.dumps(results, default=handle_non_serializable))
        return BenchmarkResult(metrics=flat_metrics(report), report=report)


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """`harness/<task>/<metric>` (and `/<filter>` for a filter other than lm-eval's `none`) for every numeric
    metric of every task and group; standard errors are left to the results file."""
    metrics = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = f"harness/{task}/{metric}" + ("" if filter_name in ("", "none") else f"/{filter_name}")
            metrics[name] = float(value)
    return metrics


def task_manager(tasks: list[str], task_paths: list[str]) -> Any:
    """lm-eval's task index, refusing a task it does not know (with the closest names). Only the `task_paths` are
    indexed when they define every task asked for; lm-eval's own tasks (thousands of files, seconds) otherwise."""
    from lm_eval.tasks import TaskManager

    for index, path in enumerate(task_paths):
        if not Path(path).is_dir():
            raise UsageError(f"task_paths[{index}]: {path} is not a directory of task YAML files")
    include = [str(Path(path).resolve()) for path in task_paths] or None
    manager = None
    if include:
        manager = TaskManager(include_path=include, include_defaults=False)
    if manager is None or any(task not in manager.all_tasks for task in tasks):
        manager = TaskManager(include_path=include, include_defaults=True)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        hints = []
        for task in unknown:
            close = difflib.get_close_matches(task, manager.all_tasks, n=3)
            hints.append(f"{task!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
        where = f" nor in {', '.join(task_paths)}" if task_paths else ""
        raise UsageError(
            f"unknown lm-eval task {', '.join(hints)}: not one of lm-eval's tasks{where}; `lm-eval ls tasks` lists "
            "them, task_paths / --include-path adds a directory of your own task YAML files"
        )
    return manager
