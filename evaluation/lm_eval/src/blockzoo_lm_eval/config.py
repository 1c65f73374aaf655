"""The config of benchmark type `lm_eval`. Torch-free."""

from __future__ import annotations

from blockzoo.api import BenchmarkConfig, at_least, check, configclass, field, greater_than


@configclass
class LmEvalConfig(BenchmarkConfig):
    """Tasks of lm-evaluation-harness, scored on the model in memory."""

    tasks: list[str] = field(
        doc="Task (or group) names: lm-eval's own (hellaswag, arc_easy, ...; their data come from the Hugging Face "
        "Hub) or those defined in `task_paths`."
    )
    task_paths: list[str] = field(
        factory=list,
        doc="Directories of task YAML files (lm-eval's --include_path), e.g. tasks over local JSON files "
        "(`dataset_path: json`, `dataset_kwargs: {data_files: ...}`). When they define every task asked for, "
        "lm-eval's own tasks are not indexed (that takes seconds).",
    )
    limit: float | None = field(
        None,
        doc="Documents per task: a count (1 or more), or a fraction (below 1) of each task's; None: all.",
        validator=greater_than(0),
    )
    num_fewshot: int | None = field(
        None, doc="Few-shot examples per prompt; None: each task's own setting.", validator=at_least(0)
    )
    batch_size: int = field(
        16,
        doc="Requests per forward pass: their token sequences are packed into one batch (no padding), longest first.",
        validator=at_least(1),
    )
    max_length: int | None = field(
        None,
        doc="Tokens a request may hold (longer contexts lose their start; generation keeps room for its new tokens). "
        "None: the `max_position_embeddings` of the Hugging Face checkpoint the model came from, else its learned "
        "positions, else 2048 (as lm-eval's Hugging Face backend).",
        validator=at_least(2),
    )
    bootstrap_iters: int = field(
        1000,
        doc="Resamples for the standard errors of metrics that have no closed form (lm-eval's bootstrap, which runs "
        "a process pool); 0: no standard errors at all.",
        validator=at_least(0),
    )

    def __attrs_post_init__(self) -> None:
        check(bool(self.tasks), "tasks", "name at least one task")
        check(all(task.strip() for task in self.tasks), "tasks", f"task names must not be empty, got {self.tasks}")
        if self.limit is not None and self.limit > 1:
            check(self.limit == int(self.limit), "limit", f"a count of documents is whole, got {self.limit}")
