# Sourced by the accelerator scripts (gpu_check.sh, w4_pair.sh): the machine's image lacks the
# `gguf` package minivllm imports. Carry its wheel in .gw/ (git-ignored; from vLLM's wheel set:
# mkdir -p .gw && cp .vl/b1/gguf-*.whl .gw/); it is installed to /tmp/gg and put on PYTHONPATH.
if ! python3 -c "import gguf" 2>/dev/null && compgen -G ".gw/gguf-*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gg .gw/gguf-*.whl &&
        export PYTHONPATH=/tmp/gg${PYTHONPATH:+:$PYTHONPATH}
fi
