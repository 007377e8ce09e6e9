"""docs/dashboard.png: the /dashboard page of a server under load, in headless Chromium.

    .venv/bin/python scripts/dashboard_screenshot.py [--model PATH] [--seconds 90]

The model: SmolLM2-135M-Instruct where scripts/setup.sh installed it, else a tiny random one.
Needs Debian's chromium and chromium-driver (scripts/setup.sh installs them where it can).
"""

import argparse
import pathlib
import signal
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' server and browser helpers

from minivllm.local_models import build_tiny_model, smollm2_path  # noqa: E402
from tests.browser import Chromium  # noqa: E402
from tests.server_utils import Load, RemoteServer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf file")
    parser.add_argument("--seconds", type=float, default=90, help="of load before the page opens (plot points)")
    parser.add_argument("--output", default=str(ROOT / "docs" / "dashboard.png"))
    args = parser.parse_args()
    model = args.model or smollm2_path() or build_tiny_model(tempfile.mkdtemp(prefix="minivllm-tiny-"))
    # A small cache (blocks of 16 tokens) that the load keeps busy: requests wait, blocks get reused.
    server = RemoteServer(model, "--max-num-seqs", "8", "--block-size", "16", "--max-model-len", "512",
                          "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "SmolLM2-135M-Instruct")
    try:
        with Load(server.url, concurrency=12, max_tokens=40, model="SmolLM2-135M-Instruct"), \
                Chromium(1280, 790) as chromium:
            time.sleep(args.seconds)
            chromium.open(f"{server.url}/dashboard")
            # Rates and hit rates are over the page's last 10 s of snapshots.
            chromium.wait_for("return Number(document.body.dataset.updates) >= 12", timeout_s=60)
            pathlib.Path(args.output).write_bytes(chromium.screenshot())
    finally:
        server.stop(signal.SIGINT)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
