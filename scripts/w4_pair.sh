#!/usr/bin/env bash
# W4 side by side on the accelerator in one run: minivllm's server, then vLLM's, each under
# vLLM's own client (.vl/tools/vllm_w4.sh: W4's three regimes, benchmarks/README.md). vLLM 0.20.1
# must be staged on the machine first (its wheel set and scripts, carried as .vl/:
# benchmarks/README.md); with the last batch, carrying .vl/tools, .vl/b4, .whl and .gw:
#   bash .vl/tools/stage.sh && bash .vl/tools/install.sh > /tmp/install.log && bash scripts/w4_pair.sh
# .gw holds the gguf wheel minivllm imports (scripts/device_gguf.sh).
# .whl, when carried, holds an httptools wheel that both servers get (a pip install of either
# has it; vLLM's staged wheel set does not). Make it here, once (.whl is git-ignored):
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl httptools
# Each server's results are packed into $OUT as soon as it is done, so a run cut short still
# returns the first; W4_SERVER_LIMIT caps each server's share of the run (seconds, default 290:
# vLLM alone starts in ~2 min).
set -u
OUT_DIR="${OUT:-/tmp/w4-out}"
mkdir -p "$OUT_DIR" /tmp/w4
if compgen -G ".whl/httptools-*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/httptools .whl/httptools-*.whl &&
        export PYTHONPATH=/tmp/httptools${PYTHONPATH:+:$PYTHONPATH}
fi
source scripts/device_gguf.sh
for name in minivllm vllm; do
    if [[ $name == minivllm ]]; then
        export SERVER_CMD="python3 -m minivllm serve" NAME=minivllm
    else
        unset SERVER_CMD; export NAME=vllm
    fi
    OUT=/tmp/w4 timeout -k 10 "${W4_SERVER_LIMIT:-290}" bash .vl/tools/vllm_w4.sh 2>&1 | tee "/tmp/w4/$name.txt"
    pkill -f "serve /tmp/w4-model" 2>/dev/null; sleep 2
    tar czf "$OUT_DIR/w4-$name.tgz" -C /tmp w4
done
