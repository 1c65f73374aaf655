"""benchmarks/harness_eval.py at --tiny: both backends run the same tasks on the same exported model, their metrics
agree, and the script prints both figures and their ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]


@pytest.mark.slow
def test_the_benchmark_script_compares_both_backends_on_the_same_model():
    result = subprocess.run(
        [sys.executable, "benchmarks/harness_eval.py", "--tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.strip().startswith("blockzoo:") and "requests/s" in line for line in lines)
    assert any(line.strip().startswith("lm-eval HFLM:") and "requests/s" in line for line in lines)
    assert any(line.startswith("ratio (blockzoo / HFLM requests/s): ") for line in lines)
    assert "metrics agree (relative 1e-4)" in lines
