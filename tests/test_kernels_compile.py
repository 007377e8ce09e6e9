"""The engine's Triton kernels compile for sm_90 (H100/H200) on a machine without a GPU: the
CPU tests run them in Triton's interpreter, which never compiles them (see
tests/kernel_compile_check.py). A subprocess, because this process runs under
TRITON_INTERPRET=1, where kernels are not compiled at all."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every kernel compiled for sm_90 with ptxas

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernel_compile_check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    assert result.stdout.count("ok ") >= 20, result.stdout  # the launches of a step were caught and compiled
