#!/usr/bin/env bash
# Set up, then generate: `bash scripts/run.sh [--model DIR_OR_GGUF] [--prompt "..."] [sampling flags]`.
# Without --model: SmolLM2-135M-Instruct (installed by setup.sh); without --prompt: two questions, as chat.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/minivllm generate "$@"
