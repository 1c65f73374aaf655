"""Training on blended data through the `Trainer` and `blockzoo train`: the same global sample order under every
layout (gloo: dp2 and sdp2 give the single-process losses), a resumed run bit-identical to a straight one,
`source_tokens` and the named validation sets in `metrics.jsonl`, and every bad blend an exit-2 error naming it.

The sources are prepared datasets of random byte tokens written here (web, code, a tiny one read whole every few
steps) and the embedded corpus; the model is the tiny transformer of the layout tests with the byte vocabulary.
"""

import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from transformer_reference import SEED, model_data, run_data, single_process

import blockzoo
from blockzoo.cli import main
from blockzoo.config import structure
from blockzoo.data.config import MemmapDatasetConfig
from blockzoo.data.dataset import build_dataset
from blockzoo.data.storage import DatasetWriter
from blockzoo.data.tokenizer import ByteTokenizer
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer
from blockzoo_testing.distributed import run_distributed

# As tests/test_sequence_data_parallel.py: the ranks sum in another order than the single process (fp32).
LOSS_TOLERANCE = {"rtol": 2e-5, "atol": 1e-7}
LENGTH, MICRO_BATCH = 16, 2
WEIGHTS = {"web": 0.5, "code": 0.2, "tiny": 0.3}
MODEL = {**model_data(), "embeddings": {"vocab_size": 257}}


def _write(prefix: Path, count: int, seed: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    with DatasetWriter(prefix, ByteTokenizer()) as writer:
        for _ in range(count):
            length = int(torch.randint(2, 30, (), generator=generator))
            writer.add(torch.randint(0, 256, (length,), generator=generator).tolist())
    return str(prefix)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sources")
    return {
        "web": _write(root / "web", 200, seed=1),
        "code": _write(root / "code", 120, seed=2),
        "tiny": _write(root / "tiny", 3, seed=3),  # a few sequences: read whole every few steps
        "code_val": _write(root / "code_val", 30, seed=4),
    }


def _blend(sources: dict[str, str]) -> dict:
    return {
        "type": "blended",
        "sequence_length": LENGTH,
        "micro_batch_size": MICRO_BATCH,
        "sources": {
            "web": {"weight": WEIGHTS["web"], "path": sources["web"], "validation_fraction": 0.2},
            "code": {"weight": WEIGHTS["code"], "path": sources["code"], "validation_fraction": 0.2},
            "tiny": {"weight": WEIGHTS["tiny"], "path": sources["tiny"]},
        },
    }


def _run_config(sources: dict, output_dir: Path, *, steps: int, accumulation: int = 1, **settings) -> RunConfig:
    training = {
        "train_iters": steps,
        "gradient_accumulation": accumulation,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup_iters": 1},
        "log_interval": 1,
        "output_dir": str(output_dir),
        "evaluation": {
            "interval": 3,
            "iters": 2 * accumulation,
            "datasets": {
                "web": {"path": sources["web"], "validation_fraction": 0.2},
                "code_val": {"path": sources["code_val"], "validation_fraction": 1},
            },
        },
        **settings.pop("training", {}),
    }
    data = run_data(MODEL, data=_blend(sources), training=training)
    data["distributed"].update(timeout=120, **settings)
    return structure(data, RunConfig)


def _metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def _greedy_counts(samples: int) -> dict[str, int]:
    """The blend's rule as stated, in exact fractions: sample i goes to the source lagging its share most."""
    shares = {name: Fraction(repr(w)) / sum(Fraction(repr(v)) for v in WEIGHTS.values()) for name, w in WEIGHTS.items()}
    counts = dict.fromkeys(WEIGHTS, 0)
    for i in range(samples):
        lags = {name: share * (i + 1) - counts[name] for name, share in shares.items()}
        counts[max(lags, key=lags.get)] += 1  # max keeps the first of equal lags
    return counts


# ---------------------------------------------------------------------------------------------------------------------
# One process: source_tokens, named validation sets, resume


def test_a_resumed_blended_run_is_bit_identical_and_logs_source_tokens_and_every_validation_set(sources, tmp_path):
    messages: list[str] = []
    straight = Trainer(
        _run_config(sources, tmp_path / "straight", steps=6, training={"checkpoint_interval": 3}),
        distributed=single_process(),
        log=messages.append,
    )
    straight.run()
    assert sum("'tiny' has been read whole" in message for message in messages) == 1, messages

    # "Killed" after step 3: a new run in another directory holding only that checkpoint continues from it.
    shutil.copytree(tmp_path / "straight" / "step_3", tmp_path / "resumed" / "step_3")
    resumed = Trainer(
        _run_config(sources, tmp_path / "resumed", steps=6, training={"checkpoint_interval": 3}),
        distributed=single_process(),
        log=lambda _: None,
    )
    assert resumed.step == 3
    resumed.run()
    assert [(r.step, r.loss, r.gradient_norm) for r in resumed.history] == [
        (r.step, r.loss, r.gradient_norm) for r in straight.history[3:]
    ]
    for name, parameter in resumed.model.named_parameters():
        assert torch.equal(parameter, dict(straight.model.named_parameters())[name]), name

    entries = _metrics(tmp_path / "straight")
    assert [entry["step"] for entry in entries] == [1, 2, 3, 4, 5, 6]
    for entry in entries:
        samples = entry["step"] * MICRO_BATCH
        assert entry["tokens"] == samples * LENGTH
        assert entry["source_tokens"] == {name: count * LENGTH for name, count in _greedy_counts(samples).items()}
    timing = {"seconds", "tokens_per_second", "tflops", "mfu"}
    resumed_entries = _metrics(tmp_path / "resumed")
    assert [entry["step"] for entry in resumed_entries] == [4, 5, 6]
    for entry, resumed_entry in zip(entries[3:], resumed_entries):
        assert {k: v for k, v in resumed_entry.items() if k not in timing} == {
            k: v for k, v in entry.items() if k not in timing
        }

    evaluations = {entry["step"]: entry for entry in entries if "evaluation_loss" in entry}
    assert sorted(evaluations) == [3, 6]
    for entry in evaluations.values():
        assert {"evaluation_loss", "evaluation_loss/web", "evaluation_loss/code_val"} <= entry.keys()
        assert len({entry["evaluation_loss"], entry["evaluation_loss/web"], entry["evaluation_loss/code_val"]}) == 3
    # The final model on each set's first two micro-batches, computed here from the sets' own datasets.
    model = blockzoo.load(tmp_path / "straight")
    for name, config in {
        "web": MemmapDatasetConfig(
            path=sources["web"], sequence_length=LENGTH, micro_batch_size=2, validation_fraction=0.2
        ),
        "code_val": MemmapDatasetConfig(
            path=sources["code_val"], sequence_length=LENGTH, micro_batch_size=2, validation_fraction=1
        ),
    }.items():
        batches = build_dataset(config, seed=SEED, training=False).evaluation_batches()
        total, labelled = 0.0, 0
        with torch.no_grad():
            for _ in range(2):
                micro = next(batches)
                logits = model.forward_packed(micro.tokens, Batch(micro.lengths.tolist()))
                mask = micro.labels != -100
                total += torch.nn.functional.cross_entropy(logits[mask], micro.labels[mask], reduction="sum").item()
                labelled += int(mask.sum())
        assert evaluations[6][f"evaluation_loss/{name}"] == pytest.approx(total / labelled, rel=1e-5), name


# ---------------------------------------------------------------------------------------------------------------------
# Layouts (gloo)

LAYOUTS = {"dp2": {}, "sdp2": {"sequence_data_parallel": 2}}


def _check_layouts(sources: dict, references: dict, root: str) -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=120)):
        for label, settings in LAYOUTS.items():
            run_config = _run_config(sources, Path(root) / label, steps=3, **settings)
            trainer = Trainer(run_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
            trainer.run()
            reference = references[label]
            assert len(trainer.history) == len(reference["history"])
            for record, (loss, norm) in zip(trainer.history, reference["history"]):
                torch.testing.assert_close(record.loss, loss, **LOSS_TOLERANCE, msg=f"{label} step {record.step}")
                torch.testing.assert_close(record.gradient_norm, norm, **LOSS_TOLERANCE, msg=f"{label} norm")
            if trainer.distributed.rank == 0:
                entries = _metrics(Path(root) / label)
                for entry, expected in zip(entries, reference["metrics"], strict=True):
                    assert entry["source_tokens"] == expected["source_tokens"], label
                    for key in ("evaluation_loss", "evaluation_loss/web", "evaluation_loss/code_val"):
                        if key in expected:
                            torch.testing.assert_close(entry[key], expected[key], **LOSS_TOLERANCE, msg=label)
            dist.barrier()


@pytest.mark.distributed
def test_blended_runs_on_two_data_ranks_or_two_sequence_slices_give_the_single_process_run(sources, tmp_path):
    references = {}
    for label, settings in LAYOUTS.items():
        data_size = 1 if settings else 2  # one process reads both data ranks' samples: as many micro-batches a step
        output = tmp_path / f"reference-{label}"
        trainer = Trainer(
            _run_config(sources, output, steps=3, accumulation=data_size),
            distributed=single_process(),
            log=lambda _: None,
        )
        trainer.run()
        references[label] = {
            "history": [(record.loss, record.gradient_norm) for record in trainer.history],
            "metrics": _metrics(output),
        }
        assert [entry["source_tokens"]["tiny"] for entry in references[label]["metrics"]] != [0, 0, 0]
    run_distributed(2, _check_layouts, sources, references, str(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# Bad blends through the command line


def _word_tokenizer(directory: Path) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = directory / "tokenizer.json"
    model.save(str(path))
    return str(path)


def test_every_bad_blend_is_an_exit_2_error_naming_the_source(sources, tmp_path, capsys):
    from blockzoo.data.tokenizer import FileTokenizer

    with DatasetWriter(tmp_path / "empty", ByteTokenizer()):
        pass
    with DatasetWriter(tmp_path / "words", FileTokenizer(_word_tokenizer(tmp_path))) as writer:
        writer.add([1, 2] * 20)
    web = {"weight": 1, "path": sources["web"]}
    cases = {
        "empty source": ({"empty": {"weight": 1, "path": str(tmp_path / "empty")}}, {}, ["'empty'", "no documents"]),
        "zero weight": ({"code": {"weight": 0, "path": sources["code"]}}, {}, ["data.sources.code.weight", "> 0"]),
        "negative weight": ({"code": {"weight": -1, "path": sources["code"]}}, {}, ["data.sources.code.weight"]),
        "missing path": ({"gone": {"weight": 1, "path": str(tmp_path / "gone")}}, {}, ["'gone'", "no dataset at"]),
        "tokenizer mismatch": (
            {"words": {"weight": 1, "path": str(tmp_path / "words")}},
            {},
            ["sources 'web' and 'words' do not share a tokenizer", "the byte tokenizer", "tokenizer.json"],
        ),
        "vocabulary beyond the model": ({}, {"model.embeddings.vocab_size": 100}, ["'web'", "model's vocabulary"]),
        "evaluation set too small": (
            {},
            {
                "training.evaluation": {
                    "interval": 1,
                    "datasets": {"small": {"path": sources["tiny"], "validation_fraction": 1, "micro_batch_size": 64}},
                }
            },
            ["training.evaluation.datasets.small", "fewer than one micro-batch"],
        ),
    }
    for case, (extra_sources, changes, expected) in cases.items():
        run = run_data(MODEL, training={"train_iters": 1, "output_dir": str(tmp_path / "run")})
        run["data"] = {**_blend(sources), "sources": {"web": web, **extra_sources}}
        for key, value in changes.items():
            section, name = key.rsplit(".", 1)
            node = run
            for part in section.split("."):
                node = node.setdefault(part, {})
            node[name] = value
        config = tmp_path / f"{case.replace(' ', '_')}.yaml"
        config.write_text(yaml.safe_dump(run))
        assert main(["train", str(config)]) == 2, case
        error = capsys.readouterr().err
        assert "Traceback" not in error and error.startswith("blockzoo: error:"), (case, error)
        for text in expected:
            assert text in error, (case, text, error)
        assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step_*")), case
    # One of them through the installed command itself.
    result = subprocess.run(
        [sys.executable, "-m", "blockzoo", "train", str(tmp_path / "zero_weight.yaml")],
        capture_output=True,
        text=True,
        env={key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")},
    )
    assert result.returncode == 2 and "data.sources.code.weight" in result.stderr and "Traceback" not in result.stderr


def test_blockzoo_config_builds_the_blend_and_names_a_bad_source(sources, tmp_path, capsys):
    run = run_data(MODEL, data=_blend(sources), training={"evaluation": {"interval": 5}})
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(run))
    assert main(["config", str(good)]) == 0
    assert "the blended data: built, a first micro-batch of each split" in capsys.readouterr().err
    run["data"]["sources"]["code"]["path"] = str(tmp_path / "absent")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(run))
    assert main(["config", str(bad)]) == 2
    error = capsys.readouterr().err
    assert "blended data source 'code'" in error and "no dataset at" in error and "Traceback" not in error
    # Data holding nothing out, with validation sets named: no evaluation split is asked of it.
    held_nothing = {**_blend(sources), "sources": {"web": {"weight": 1, "path": sources["web"]}}}
    evaluation = {"interval": 5, "datasets": {"code": {"path": sources["code"], "validation_fraction": 0.2}}}
    named = tmp_path / "named.yaml"
    named.write_text(yaml.safe_dump(run_data(MODEL, data=held_nothing, training={"evaluation": evaluation})))
    assert main(["config", str(named)]) == 0, capsys.readouterr().err


def test_the_walkthrough_example_prepares_its_sources_and_trains(tmp_path, capsys):
    """examples/blended_data.py makes and prepares the sources; examples/blended.yaml trains on them (a few short
    steps here), logging every named validation set and source_tokens."""
    for needed in ("blockzoo_corpora", "tokenizers"):  # what the example's data needs
        pytest.importorskip(needed)
    root = Path(__file__).resolve().parent.parent
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(root / "examples" / "blended_data.py"), "--output", str(data)],
        check=True,
        capture_output=True,
        env={key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")},
    )
    paths = [f"data.sources.{name}.path={data / name}" for name in ("web", "code", "math")]
    paths += [f"training.evaluation.datasets.{name}.path={data / name}" for name in ("web", "code", "math_val")]
    output = tmp_path / "run"
    short = ["training.train_iters=2", "training.evaluation.interval=2", "training.evaluation.iters=1"]
    short += ["data.sequence_length=64", "data.micro_batch_size=2", f"training.output_dir={output}"]
    assert main(["train", str(root / "examples" / "blended.yaml"), *paths, *short]) == 0, capsys.readouterr().err
    (entry,) = [entry for entry in _metrics(output) if entry["step"] == 2]
    assert {"evaluation_loss", "evaluation_loss/web", "evaluation_loss/code", "evaluation_loss/math_val"} <= set(entry)
    assert entry["source_tokens"] == {"web": 2 * 64, "code": 64, "math": 64}  # 4 sequences: 0.6 / 0.25 / 0.15


def test_plot_draws_a_sources_tokens_by_its_flat_name(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    lines = [
        {"step": step, "tokens": 32 * step, "source_tokens": {"web": 16 * step, "code": 16 * step}} for step in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["plot", str(tmp_path), "--metric", "source_tokens/web", "-o", str(tmp_path / "web.png")]) == 0
    assert (tmp_path / "web.png").read_bytes().startswith(b"\x89PNG")
    assert main(["plot", str(tmp_path), "--metric", "source_tokens", "-o", str(tmp_path / "x.png")]) == 2
    assert "its metrics: source_tokens/code, source_tokens/web, tokens" in capsys.readouterr().err
