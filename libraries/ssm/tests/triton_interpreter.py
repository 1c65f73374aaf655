"""Running Triton kernels under Triton's CPU interpreter, for the kernels' CPU tests.

The interpreter is chosen when a kernel is defined (from TRITON_INTERPRET), so a test module runs its interpreter
cases in a subprocess of its own file (`python FILE --interpreter`), which calls `patch_for_numpy()` first.
"""

import os
import subprocess
import sys
import time

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


def run_interpreter_cases(test_file: str) -> None:
    """Run `test_file --interpreter` under TRITON_INTERPRET=1 (skipped without triton or numpy); fail with its output
    if it exits non-zero."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # Triton's interpreter runs on numpy.
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, test_file, "--interpreter"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(result.stdout, f"interpreter run: {time.perf_counter() - started:.1f} s")
    assert result.returncode == 0, result.stdout + result.stderr
