"""Run a script of Triton kernel checks on CPU under Triton's interpreter (TRITON_INTERPRET=1).

The interpreter must be switched on before triton is imported, so each script runs in its own
process; it signals success by printing "ok" last. Shared by the kernel tests
(`pythonpath = ["tests"]` in pyproject).
"""

import os
import subprocess
import sys


def run_interpreted(script: str, *args: str, timeout: float = 300) -> None:
    """Run `script` with `args` under the interpreter; fail with its stderr unless it ends with "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
