"""The API process's CPU time per streamed token event, on a tiny CPU model.

    python3 -m benchmarks.server_cpu [--streams 128] [--tokens 200] [--runs 3]
    python3 -m benchmarks.server_cpu --runs 1 --py-spy /tmp/api.txt
    python3 -m benchmarks.server_cpu --runs 1 --attach "perf record -F 999 -g -o /tmp/api.data -p {pid}"

Starts `minivllm serve` on a tiny random-weight model (engine on the CPU), then per run sends
`--streams` streaming completions at once (ignore_eos, `--tokens` tokens each, through
benchmarks/serving.py's client) and divides the CPU time the API process spent over the run
(user + system, read from the OS; its engine-core child is not counted) by the token events
(one per generated token). The engine's speed does not matter here, only the front's cost
per event, which includes each request's own share (HTTP, validation, tokenization). The CPU
time is also split into the event loop's thread and the others (results reader, command
sender, tokenizer pool). The client and the engine share the machine: on two cores, expect
a spread of tens of percent between runs.

Profiling: --attach runs a command during the last run ({pid}: the API process), stopped with
SIGINT at its end; --py-spy PATH is the py-spy command (`pip install py-spy`) that records
the stacks of the threads holding the GIL, as collapsed stacks with line numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import psutil

from benchmarks.serving import Prompt, Regime, open_clients, run_regime

PROMPT_TOKENS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, port: int, max_num_seqs: int, max_model_len: int,
                 log_path: str) -> subprocess.Popen[bytes]:
    """`minivllm serve` as the tests start it (one intra-op thread), up once /health answers."""
    command = [sys.executable, "-m", "minivllm", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--disable-uvicorn-access-log",
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not come up; see {log_path}")
        time.sleep(0.2)


def py_spy_command(output: str) -> str:
    """py-spy (beside this interpreter, else on PATH) recording the API process's GIL holders."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    path = beside if os.path.exists(beside) else shutil.which("py-spy")
    if path is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return f"{shlex.quote(path)} record --pid {{pid}} --format raw --rate 500 --gil --nonblocking " \
           f"--output {shlex.quote(output)}"


@dataclass
class CPUTimes:
    """Seconds of CPU time of the API process alone (its children are not counted)."""

    user: float
    system: float
    loop: float  # the main thread's user + system: the event loop's share

    @staticmethod
    def of(process: psutil.Process) -> CPUTimes:
        times = process.cpu_times()
        loop = sum(t.user_time + t.system_time for t in process.threads() if t.id == process.pid)
        return CPUTimes(times.user, times.system, loop)

    def __sub__(self, other: CPUTimes) -> CPUTimes:
        return CPUTimes(self.user - other.user, self.system - other.system, self.loop - other.loop)


async def measure(base_url: str, prompts: list[Prompt], api: psutil.Process) -> tuple[CPUTimes, int, float]:
    """One run: the API process's CPU time over it, the token events received, wall seconds."""
    regime = Regime(len(prompts), None, math.inf)
    async with open_clients(len(prompts)) as clients:
        before = CPUTimes.of(api)
        metrics = await run_regime(clients, base_url, "tiny", prompts, regime)
        used = CPUTimes.of(api) - before
    if metrics["failed"]:
        raise SystemExit(f"{metrics['failed']} requests failed: {metrics['errors'][0]}")
    return used, metrics["total_output_tokens"], metrics["duration"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=128, help="concurrent streaming requests per run")
    parser.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--attach", default=None, metavar="COMMAND",
                        help="run this during the last run, {pid} replaced by the API process's pid")
    parser.add_argument("--py-spy", default=None, metavar="PATH",
                        help="record the API process with py-spy during the last run (collapsed stacks)")
    args = parser.parse_args()
    attach = py_spy_command(args.py_spy) if args.py_spy else args.attach

    from transformers import AutoTokenizer

    from minivllm.local_models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # Prompts of PROMPT_TOKENS words from the demo vocabulary, each from its own start.
        words = [tokenizer.decode([t]) for t in range(100, 400)]
        prompts = [Prompt("".join(words[(i * 7 + j) % len(words)] for j in range(PROMPT_TOKENS)), PROMPT_TOKENS,
                          args.tokens) for i in range(args.streams)]
        port, log_path = free_port(), os.path.join(tmp, "server.log")
        server = start_server(model_dir, port, args.streams, PROMPT_TOKENS * 4 + args.tokens, log_path)
        base_url = f"http://127.0.0.1:{port}"
        api = psutil.Process(server.pid)
        try:
            asyncio.run(measure(base_url, prompts[:8], api))  # warm-up: first-call costs out of the way
            per_event = []
            for run in range(args.runs):
                profiler = None
                if attach and run == args.runs - 1:
                    profiler = subprocess.Popen(shlex.split(attach.format(pid=server.pid)),
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)  # it attaches
                used, events, duration = asyncio.run(measure(base_url, prompts, api))
                if profiler is not None:
                    profiler.send_signal(signal.SIGINT)
                    profiler.wait(60)
                per_event.append((used.user + used.system) / events * 1e6)
                print(f"run {run + 1}: {events} token events in {duration:.2f} s; API process CPU "
                      f"{used.user:.2f} s user + {used.system:.2f} s system = {per_event[-1]:.1f} us per event "
                      f"(event loop thread {used.loop / events * 1e6:.1f}, other threads "
                      f"{(used.user + used.system - used.loop) / events * 1e6:.1f})", flush=True)
            print(f"median: {statistics.median(per_event):.1f} us per event "
                  f"({args.streams} streams x {args.tokens} tokens, {args.runs} runs)")
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    main()
