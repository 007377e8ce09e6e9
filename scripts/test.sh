#!/usr/bin/env bash
# Set up, then run the CPU test suite (Triton kernels through its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
