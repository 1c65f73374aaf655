"""`blockzoo plot RUN [RUN ...]`: the curves of a metric (default: the loss, with the evaluation loss dashed) of
one or several runs, from their `metrics.jsonl`, drawn to a PNG with matplotlib (the optional extra `plot`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blockzoo.errors import UsageError
from blockzoo.training.metrics import METRICS_FILE, read_metrics

INSTALL_HINT = "pip install 'blockzoo[plot]' (or pip install matplotlib)"


def run_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The metrics of a run directory (or of a metrics file given directly); a clear error when it has none."""
    path = Path(run)
    path = path if path.is_file() else path / METRICS_FILE
    if not path.parent.is_dir():
        raise UsageError(f"{run}: does not exist")
    if not path.is_file():
        raise UsageError(f"{run} has no {METRICS_FILE} (a run writes it in its output_dir as it logs steps)")
    entries = read_metrics(path)
    if not entries:
        raise UsageError(f"{path} holds no metrics yet")
    return entries


def plot_runs(runs: list[str], output: str | Path, metric: str = "loss") -> Path:
    """Draw `metric` against the step for each run into the PNG `output`; the evaluation loss too for `loss`."""
    # Every run is checked before matplotlib is imported; a figure per source (`source_tokens`) is `source_tokens/web`.
    metrics = {run: [_flat(entry) for entry in run_metrics(run)] for run in runs}
    drawn = [metric] + (["evaluation_loss"] if metric == "loss" else [])
    for run, entries in metrics.items():
        if not any(name in entry for entry in entries for name in drawn):
            names = sorted({name for entry in entries for name in entry if name != "step"})
            raise UsageError(f"{run} logged no {metric!r}; its metrics: {', '.join(names)}")
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"blockzoo plot needs matplotlib: {INSTALL_HINT}") from None
    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 5))
    for index, (run, entries) in enumerate(metrics.items()):
        color = f"C{index % 10}"
        for name, style in zip(drawn, ("-", "--")):
            points = [(entry["step"], entry[name]) for entry in entries if entry.get(name) is not None]
            if points:
                label = run if name == metric else f"{run} ({name.replace('_', ' ')})"
                axes.plot(*zip(*points), style, color=color, label=label, marker="." if len(points) < 30 else None)
    axes.set_xlabel("step")
    axes.set_ylabel(metric.replace("_", " "))
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, format="png", dpi=100)
    pyplot.close(figure)
    return output


def _flat(entry: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The figures of an entry by flat name: nested mappings joined with `/`."""
    flat: dict[str, Any] = {}
    for key, value in entry.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
