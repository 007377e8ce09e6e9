#!/usr/bin/env bash
# Set up, lint and type-check, then run the CPU test suite (Triton kernels through its
# interpreter). Arguments go to pytest: -m "not slow" runs the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Headless Chromium and its WebDriver (Debian's packages) for the dashboard's browser test,
# where apt can install them; without them that test is skipped.
if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver; } >/dev/null 2>&1 || echo "test.sh: could not install chromium (the browser test is skipped)"
fi
.venv/bin/ruff check .
.venv/bin/mypy minivllm
# Two workers, each test file whole on one (its module fixtures, Ray's cluster): the suite waits
# on servers and subprocesses as much as it computes, so two halve its time on two cores.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
