"""cpu_threads: the engine's intra-op threads from the cores the process may use, unless the
user chose a count."""

from collections.abc import Iterator

import pytest
import torch

from minivllm.config import cpu_threads


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An affinity mask of 4 cores, no OMP_NUM_THREADS; torch's thread count put back after."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_torch_default_leaves_the_reserved_cores(four_cores: None) -> None:
    torch.set_num_threads(4)  # torch's default: the cores in the mask
    assert cpu_threads() == 4
    assert cpu_threads(reserved_cores=1) == 3
    assert cpu_threads(reserved_cores=4) == 1
    assert cpu_threads(reserved_cores=1, num_engines=2) == 1  # data-parallel replicas share them
    assert cpu_threads(num_engines=2) == 2


def test_an_explicit_count_wins(four_cores: None, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(2)  # the user's torch.set_num_threads
    assert cpu_threads(reserved_cores=1) == 2
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert cpu_threads(reserved_cores=1) == 4
    assert cpu_threads(reserved_cores=1, num_engines=2) == 4  # per engine
