"""Run one of vLLM's staged benchmark scripts (.vl/tools/vllm_*.py) with its attention backend
chosen. vLLM 0.20.1 ignores the VLLM_ATTENTION_BACKEND variable (it picks FLASH_ATTN on an H200)
and takes the backend as an engine argument, which those scripts do not pass; this passes it to
every LLM(...) they build. On the accelerator, once vLLM is staged (benchmarks/README.md):

    PYTHONPATH=/tmp/vlsite python3 scripts/vllm_backend.py TRITON_ATTN .vl/tools/vllm_w1.py [its args]
"""

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    backend, script = sys.argv[1], sys.argv[2]
    import vllm

    build = vllm.LLM.__init__

    def build_with_backend(self: vllm.LLM, *args: object, **kwargs: object) -> None:
        build(self, *args, attention_backend=backend, **kwargs)

    vllm.LLM.__init__ = build_with_backend
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
