"""Test configuration: markers skip exactly what is missing, and in CI nothing may be missing
except a GPU (the extension must be built, Triton must run under its interpreter)."""
from __future__ import annotations

import os

import pytest  # noqa: E402
import torch  # noqa: E402  (importing torch does not import triton)

# Triton reads this when it is imported: without a GPU, its CPU interpreter is how the Triton
# kernels run in tests (fp32, small shapes).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers (`-n N`) share the machine's cores: each runs torch on its share, as
# N workers each spinning every core's worth of threads would run slower than one alone
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))

from utils import IN_CI, ext_available, triton_cpu_available  # noqa: E402
from serving_fixtures import serving_world  # noqa: E402,F401  (tests/serving's fixture)


@pytest.fixture(scope="session", autouse=True)
def working_folder(tmp_path_factory):
    """The tests run in an empty folder of their own (once collected), not the folder pytest
    was started in: a `python -c` or `python -m` child puts its working folder first on its
    path, and in the repository's root that imports the source rag_fast, without the compiled
    extension. (Tests name their files by absolute paths; one of them used to leave the
    working folder elsewhere for every test after it, which a parallel run's workers did not
    all get.)"""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)


@pytest.fixture(autouse=True)
def fixed_threads(monkeypatch):
    """Every test runs with its thread count fixed (RAG_FAST_THREADS, inherited by the commands
    tests start): the trainer's adaptive policy reacts to other processes on the machine, and
    a test's output must not depend on how busy the machine is. tests/test_threads.py unsets
    it where it tests the policy."""
    monkeypatch.setenv("RAG_FAST_THREADS", str(torch.get_num_threads()))


@pytest.fixture(autouse=True)
def glibc_left_alone(monkeypatch):
    """The Trainer's keep_freed_memory would change glibc's malloc thresholds for the rest of
    the test session (tests measuring memory or page faults would then depend on the order the
    tests ran in): in this process it acts as if unavailable. tests/test_heap.py resets it, and
    checks it in fresh processes; commands the tests start apply it as users' runs do."""
    from rag_fast.training import heap

    monkeypatch.setattr(heap, "_outcome", "unavailable")


@pytest.fixture
def one_thread():
    """torch on one thread for the test (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    tiny models gain nothing from a second thread, and on shared cores spinning threads cost a
    lot."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    have = {
        "requires_ext": ext_available(),
        "requires_triton": torch.cuda.is_available() or triton_cpu_available(),
    }
    if IN_CI:
        missing = [name for name, ok in have.items() if not ok]
        if missing:
            raise pytest.UsageError(f"CI must be able to run every test; missing: {missing}")
    for item in items:
        for name, ok in have.items():
            if not ok and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=f"{name}: not available here"))
