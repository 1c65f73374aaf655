"""Running a plugin's Triton kernels under Triton's CPU interpreter, for tests on machines without a GPU.

The interpreter is chosen when a kernel is defined (from TRITON_INTERPRET), so a test module runs its interpreter
cases in a subprocess of its own file: `run_interpreter_cases(__file__, "--interpreter")` from the test, and under
`if __name__ == "__main__":` the file calls `patch_for_numpy()` and then its cases, exiting non-zero on a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest


def patch_for_numpy() -> None:
    """Triton 3.6's interpreter converts 1-element arrays with int(), which numpy >= 2.4 refuses; the fix of
    triton-lang/triton#9171, applied here until the pinned triton has it."""
    import numpy as np
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_scalar_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(())))

    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index


def patch_bf16_dots() -> None:
    """Triton's interpreter keeps bfloat16 values as their uint16 bit patterns, and its `tl.dot` multiplies those
    (triton-lang/triton#11584, not supported upstream): bfloat16 operands are widened to float32 first. The widening
    is exact and the GPU's products of bf16 values are exact in its fp32 accumulator, so a kernel's bf16 dots are
    checked for what the GPU computes."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened(operand):
        if operand.dtype != tl.bfloat16:
            return operand
        return interpreter.TensorHandle((operand.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot_of_widened(self, a, b, *arguments):
        return create_dot(self, widened(a), widened(b), *arguments)

    interpreter.InterpreterBuilder.create_dot = create_dot_of_widened


def run_interpreter_cases(
    test_file: str, *arguments: str, overflow_is_error: bool = False, timeout: float = 900
) -> None:
    """Run `python test_file ARGUMENTS` under TRITON_INTERPRET=1 (skipped without triton or numpy) and fail with its
    output if it exits non-zero. `overflow_is_error`: numpy's overflow and invalid-value warnings fail the run, so a
    kernel that computes from values it should have masked (even where the result is discarded) is caught."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # Triton's interpreter runs on numpy.
    options: Sequence[str] = ("-W", "error::RuntimeWarning") if overflow_is_error else ()
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, *options, test_file, *arguments],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(result.stdout, f"interpreter run: {time.perf_counter() - started:.1f} s")
    assert result.returncode == 0, result.stdout + result.stderr
