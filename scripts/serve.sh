#!/usr/bin/env bash
# Set up, then serve the OpenAI API: `bash scripts/serve.sh [MODEL_DIR] [minivllm serve flags]`.
# Without MODEL_DIR it serves the small random-weight demo model (its text is gibberish).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [[ $# -eq 0 || "$1" == -* ]]; then
    model=$(.venv/bin/python -c "from minivllm.demo import demo_model_dir; print(demo_model_dir())")
    echo "No model directory given: serving the small demo model with RANDOM weights ($model)." >&2
    set -- "$model" --served-model-name demo "$@"
fi
exec .venv/bin/minivllm serve "$@"
