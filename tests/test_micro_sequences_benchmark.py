"""benchmarks/micro_sequences.py measures what it says at its --tiny shapes: the same loss whole and in chunks, with
and without recomputation, and figures of memory that are there (the fresh-process suite itself is `slow`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import micro_sequences

REPOSITORY = Path(__file__).resolve().parent.parent


def test_one_setting_measures_the_same_step_whole_and_in_chunks():
    whole = micro_sequences.measure(256, None, "none", tiny=True)
    chunked = micro_sequences.measure(256, 64, "full", tiny=True)
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-6)


def test_a_setting_measured_in_a_fresh_process_has_its_forward_resident():
    # The suite measures each setting in a process of its own, as here: in a test worker that ran other tests, the
    # forward reuses memory already resident and its growth can be 0 or less (CI once saw -0.01 MiB).
    result = subprocess.run(
        [sys.executable, "benchmarks/micro_sequences.py", "--one", "256", "none", "none", "--tiny"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    )
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["held_mib"] > 0 and record["peak_mib"] >= record["held_mib"]


@pytest.mark.slow
def test_the_suite_runs_each_setting_in_a_fresh_process(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/micro_sequences.py", "--tiny", "--json", str(tmp_path / "results.jsonl")],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    )
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 6 and result.stdout.count("\n| ") == 7  # the table: its rule and six settings
    assert len({round(record["loss"], 5) for record in records}) == 1
    by_setting = {(record["recompute"], record["micro_sequence_length"]): record for record in records}
    # Recomputed in chunks, the step holds less after its forward than the plain whole step.
    assert by_setting["full", 64]["held_mib"] < by_setting["none", None]["held_mib"]
