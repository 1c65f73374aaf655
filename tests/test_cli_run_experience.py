"""Through the `blockzoo` command as a user runs it: what a run says at start
(parameters per kind of layer, tokens per step, output directory, resume or nothing to do), its step lines (the
last step logged below log_interval, MoE losses summed per kind), its metrics file (checked against the in-process
trainer's own records; truncated on resume), the progress bar on a terminal only, `blockzoo plot`, and a type
override that keeps the fields the new type has (a run whose evaluation cannot happen refused before a step)."""

import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import blockzoo
from blockzoo.config import load
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer

ROOT = Path(__file__).parents[1]
ENVIRONMENT = {key: value for key, value in os.environ.items() if not key.startswith(("BLOCKZOO_", "TQDM_"))}
RUN = {
    "model": {
        "hidden_size": 32,
        "embeddings": {"vocab_size": 257},
        "decoder": {
            "num_blocks": 2,
            "block": {
                "mixer": {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8},
                "mlp": {"type": "moe", "experts": 4, "experts_per_token": 2, "intermediate_size": 16},
            },
        },
    },
    "distributed": {"seed": 3},
    "data": {"type": "embedded", "num_documents": 40, "sequence_length": 32, "micro_batch_size": 2},
    # train_iters below log_interval: only the last step logs; an evaluation at step 2 and at the end.
    "training": {"train_iters": 3, "log_interval": 10, "evaluation": {"interval": 2, "iters": 1}},
}


def blockzoo_command(*arguments, **options) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "blockzoo", *map(str, arguments)]
    return subprocess.run(command, capture_output=True, text=True, env=ENVIRONMENT, timeout=300, **options)


def write_config(directory: Path, **training) -> Path:
    path = directory / "run.yaml"
    run = {**RUN, "training": {**RUN["training"], "output_dir": str(directory / "run"), **training}}
    path.write_text(yaml.safe_dump(run))
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 3 steps by `blockzoo train` (stderr not a terminal), and the same run in-process (the reference)."""
    directory = tmp_path_factory.mktemp("trained")
    config = write_config(directory)
    result = blockzoo_command("train", config)
    assert result.returncode == 0, result.stdout + result.stderr
    reference = load(RunConfig, config, [f"training.output_dir={directory / 'reference'}"])
    logged = []
    with Trainer(reference, log=logged.append) as trainer:
        history = trainer.run()
    return directory, result, history, trainer.evaluations


def _count(number: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if number >= size:
            return f"{number / size:.3g}{unit}"
    return str(number)


def test_a_run_says_what_it_will_do(trained):
    directory, result, _, _ = trained
    lines = result.stdout.splitlines()
    # Parameter counts per kind of layer, from the model's parameter names.
    model = blockzoo.build(directory / "run.yaml")
    sizes = {name: parameter.numel() for name, parameter in model.named_parameters()}

    def total(test) -> int:
        return sum(size for name, size in sizes.items() if test(name))

    expected = {  # kind: (parameters, layers)
        "embeddings": (total(lambda name: name.startswith("embeddings.")), 1),
        "mixer attention": (total(lambda name: ".mixer." in name), 2),
        "mlp moe": (total(lambda name: ".mlp." in name), 2),
        "normalization rms_norm": (total(lambda name: "norm" in name), 5),  # 2 per block, the head's
        "head": (total(lambda name: name == "head.output_weight"), 1),
    }
    assert sum(size for size, _ in expected.values()) == sum(sizes.values())
    parameters = next(line for line in lines if line.startswith("parameters: "))
    assert parameters.startswith(f"parameters: {_count(sum(sizes.values()))} — "), parameters
    for kind, (size, layers) in expected.items():
        assert f"{kind} {_count(size)}" + (f" in {layers} layers" if layers > 1 else "") in parameters, parameters
    assert "tokens per step: 64 (2 sequences of 32 tokens × 1 micro-batch × 1 data-parallel rank)" in lines
    assert f"output directory {directory / 'run'}: a new run of 3 steps" in lines


def test_step_lines_and_the_metrics_file(trained):
    directory, result, history, evaluations = trained
    lines = result.stdout.splitlines()
    # train_iters (3) below log_interval (10): the last step is logged, the others are not.
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == ["step 3/3"]
    entries = metrics(directory / "run")
    assert [entry["step"] for entry in entries] == [2, 3]  # the evaluation at step 2, step 3's line
    assert entries[0] == {"step": 2, "tokens": 2 * 64, "evaluation_loss": evaluations[0][1]}
    last, reference = entries[-1], history[-1]
    assert evaluations == [(2, entries[0]["evaluation_loss"]), (3, last["evaluation_loss"])]
    assert last["tokens"] == 3 * 64
    assert (last["loss"], last["learning_rate"], last["gradient_norm"]) == (
        reference.loss,
        reference.learning_rate,
        reference.gradient_norm,
    )
    # Every named loss in the file, under its full name; on the line, summed per kind.
    assert set(reference.losses) == {"decoder.0.mlp.load_balancing", "decoder.1.mlp.load_balancing"}
    assert {name: last[name] for name in reference.losses} == reference.losses
    line = next(line for line in lines if line.startswith("step 3/3"))
    assert f"load_balancing (2 layers) {sum(reference.losses.values()):.4g} |" in line
    assert f"loss {reference.loss:.4f}" in line and "decoder.0" not in line and len(line) < 160, line
    assert f"evaluation at step 2: loss {evaluations[0][1]:.4f}" in lines
    # Not a terminal: plain lines, no progress bar.
    assert "\r" not in result.stderr and "step/s" not in result.stderr and "s/step" not in result.stderr


def test_a_resumed_run_replaces_the_metrics_of_steps_it_trains_again(trained, tmp_path):
    directory, _, _, _ = trained
    shutil.copytree(directory / "run", tmp_path / "run")
    config = write_config(tmp_path, train_iters=4)
    # As left by a run killed after step 5 with its last checkpoint at step 3 (and a partial last line).
    with (tmp_path / "run" / "metrics.jsonl").open("a") as file:
        file.write('{"step": 4, "loss": 99.0}\n{"step": 5, "loss": 99.0}\n{"step": 6, "lo')
    result = blockzoo_command("train", config)
    assert result.returncode == 0, result.stderr
    step_3 = tmp_path / "run" / "step_3"
    assert f"output directory {tmp_path / 'run'}: resuming from {step_3} at step 3, training to step 4" in result.stdout
    entries = metrics(tmp_path / "run")
    assert [entry["step"] for entry in entries] == [2, 3, 4]
    assert entries[:2] == metrics(directory / "run")
    assert entries[2]["loss"] != 99.0 and f"step 4/4 | loss {entries[2]['loss']:.4f}" in result.stdout

    again = blockzoo_command("train", config)
    assert again.returncode == 0, again.stderr
    assert (
        f"nothing to do: the run in {tmp_path / 'run'} is complete ({tmp_path / 'run' / 'step_4'} is at step 4, "
        "training.train_iters is 4; raise it to train further)"
    ) in again.stdout
    assert "step 4/4" not in again.stdout and metrics(tmp_path / "run") == entries


def test_a_terminal_shows_a_progress_bar(tmp_path):
    config = write_config(tmp_path, train_iters=2, log_interval=1, evaluation={"interval": None})
    controller, terminal = pty.openpty()
    # A wide terminal, so the bar is not cut.
    import fcntl
    import termios

    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    command = [sys.executable, "-m", "blockzoo", "train", str(config)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=terminal, env=ENVIRONMENT)
    os.close(terminal)
    shown = b""
    while True:
        ready, _, _ = select.select([controller], [], [], 300)
        if not ready:
            break
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        shown += chunk
    stdout = process.stdout.read().decode()
    assert process.wait(timeout=60) == 0
    os.close(controller)
    bar = shown.decode(errors="replace")
    assert "training: 100%" in bar and "2/2 [" in bar, bar  # the step count, elapsed<ETA, rate
    assert "step/s" in bar or "s/step" in bar, bar
    assert "step 1/2 | loss" in stdout and "step 2/2 | loss" in stdout  # the lines still go to stdout


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo plot


def test_plot_draws_several_runs_to_a_png(trained, tmp_path):
    directory, _, _, _ = trained
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": step, "loss": 6 - step}) + "\n" for step in (1, 2))
    )
    output = tmp_path / "plots" / "loss.png"
    result = blockzoo_command("plot", directory / "run", other, "-o", output)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {output}\n"
    data = output.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (800, 500) and 10_000 < len(data) < 2_000_000


def test_plot_of_a_run_without_metrics_is_a_usage_error(tmp_path):
    result = blockzoo_command("plot", tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr
        == f"blockzoo: error: {tmp_path} has no metrics.jsonl (a run writes it in its output_dir as it logs steps)\n"
    )


def test_plot_of_a_metric_the_run_did_not_log_names_those_it_did(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens": 8}\n')
    result = blockzoo_command("plot", tmp_path, "--metric", "grad_norm")
    assert result.returncode == 2
    assert result.stderr == f"blockzoo: error: {tmp_path} logged no 'grad_norm'; its metrics: loss, tokens\n"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    hide = "import sys; sys.modules['matplotlib'] = None; from blockzoo.cli import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", hide, "plot", str(tmp_path)], capture_output=True, text=True, env=ENVIRONMENT
    )
    assert result.returncode == 2
    assert result.stderr == (
        "blockzoo: error: blockzoo plot needs matplotlib: pip install 'blockzoo[plot]' (or pip install matplotlib)\n"
    )


# ---------------------------------------------------------------------------------------------------------------------
# A type changed by override keeps the fields the new type has; evaluation that cannot happen is refused up front


@pytest.fixture
def memmap_data(tmp_path) -> Path:
    for index in range(30):
        (tmp_path / f"story_{index}.txt").write_text(f"Story {index}: " + "once upon a time " * 40)
    prefix = tmp_path / "stories"
    result = blockzoo_command("prepare", *sorted(tmp_path.glob("story_*.txt")), "--output", prefix)
    assert result.returncode == 0, result.stderr
    return prefix


def test_demo_with_memmap_data_keeps_its_batch_shape(memmap_data):
    result = blockzoo_command("config", ROOT / "examples" / "demo.yaml", "data.type=memmap", f"data.path={memmap_data}")
    assert result.returncode == 0, result.stderr
    data = yaml.safe_load(result.stdout)["data"]
    demo = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())["data"]
    assert data["type"] == "memmap" and data["path"] == str(memmap_data)
    assert (data["sequence_length"], data["micro_batch_size"]) == (demo["sequence_length"], demo["micro_batch_size"])
    assert data["validation_fraction"] == 0.0  # the memmap default: the embedded type's default is not carried


def test_a_run_whose_evaluation_cannot_happen_is_refused_before_the_first_step(memmap_data, tmp_path):
    output = tmp_path / "run"
    overrides = ["data.type=memmap", f"data.path={memmap_data}", f"training.output_dir={output}"]
    result = blockzoo_command("train", ROOT / "examples" / "demo.yaml", *overrides)
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "Traceback" not in message and "\n" not in message, message
    assert message.startswith("blockzoo: error: training.evaluation.interval is 100, but the evaluation split holds 0 ")
    assert "data.validation_fraction" in message and "training.evaluation.interval=null" in message
    assert "step 1/" not in result.stdout and not list(output.glob("step_*"))
