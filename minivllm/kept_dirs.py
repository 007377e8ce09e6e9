"""Directories minivllm builds once and keeps, under $XDG_CACHE_HOME (or ~/.cache)/minivllm/."""

import os
import shutil
import tempfile
from collections.abc import Callable


def kept_dir(name: str, build: Callable[[str], object]) -> str:
    """The path of the kept directory `name`, which build(directory) fills on first use.

    Built in a temporary directory and renamed into place, so concurrent first uses never
    see a half-written one."""
    cache_root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    final = os.path.join(cache_root, "minivllm", name)
    if os.path.isdir(final):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=parent)
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (rename onto a non-empty directory fails): its
            # build is identical, use it.
            if not os.path.isdir(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
