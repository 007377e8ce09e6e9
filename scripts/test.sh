#!/usr/bin/env bash
# Set up, lint and type-check, then run the CPU test suite (Triton kernels through its
# interpreter). Arguments go to pytest: -m "not slow" runs the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy minivllm
exec .venv/bin/python -m pytest -q "$@"
