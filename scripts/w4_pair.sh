#!/usr/bin/env bash
# W4 side by side on the accelerator in one call: minivllm's server, then vLLM's, each under
# vLLM's own client (../shared/peer/vllm_w4.sh: three regimes). Run it after the peer's staging
# calls (../shared/peer/README.md), in the same call as the last one:
#   run("bash .vl/tools/stage.sh && bash .vl/tools/install.sh > /tmp/install.log && bash scripts/w4_pair.sh",
#       carry=[".vl/tools", ".vl/b4", ".whl", ".gw"])
# .gw holds the gguf wheel minivllm imports (scripts/device_gguf.sh).
# .whl, when carried, holds an httptools wheel that both servers get (a pip install of either
# has it; the peer's wheel set does not). Make it here, once (.whl is git-ignored):
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl httptools Each server's results are packed into $OUT as soon as
# it is done, so a call cut short still returns the first; W4_SERVER_LIMIT caps each server's
# share of the call (seconds, default 290: a call may run 600 s and vLLM alone starts in ~2 min).
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
