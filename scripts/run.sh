#!/usr/bin/env bash
# Set up, then generate: `bash scripts/run.sh [--model DIR] [--prompt "..."] [sampling flags]`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/minivllm generate "$@"
