"""benchmarks/memory.py: a step's absolute memory, measured in a fresh process, on known sizes."""
from __future__ import annotations

import pathlib
import sys
import textwrap

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import memory  # noqa: E402

MiB = 2**20

# A "model" of 96 MiB; the first step leaves 48 MiB of "gradients" that later steps keep; every
# step allocates, touches and frees a 192 MiB temporary (plus a 64 MiB one freed before it).
FAKE = textwrap.dedent("""
    import numpy as np

    def make(model_mib, grad_mib, temp_mib):
        model = np.ones(model_mib * 2**20, dtype=np.uint8)
        state = {}

        def step():
            small = np.ones(64 * 2**20, dtype=np.uint8)  # freed before the big one: not a peak
            del small
            temp = np.ones(temp_mib * 2**20, dtype=np.uint8)
            if "grad" not in state:
                state["grad"] = np.zeros(grad_mib * 2**20, dtype=np.uint8)
                state["grad"][:] = 1
            state["grad"] += temp[: grad_mib * 2**20]
            return int(model[0]) + int(temp[-1])

        return step

    def broken(n):
        raise ValueError(f"no model of size {n}")

    def step_fails():
        def step():
            raise MemoryError("step ran out")
        return step
""")


@pytest.fixture()
def fake_module(tmp_path):
    (tmp_path / "fake_provider.py").write_text(FAKE)
    return str(tmp_path)


def test_known_allocation(fake_module):
    m = memory.step_memory("fake_provider:make", 96, 48, 192, path=(fake_module,),
                           imports=("numpy",))
    # whole step: model + kept gradients + the step's temporary
    assert m.whole_step_peak_mb == pytest.approx(96 + 48 + 192, abs=6)
    # over the post-warm-step baseline: only the temporary (the gradients already exist)
    assert m.step_extra_mb == pytest.approx(192, abs=6)
    assert m.state_mb == pytest.approx(96 + 48, abs=6)
    assert m.bare_mb > 0


def test_sizes_are_told_apart(fake_module):
    small = memory.step_memory("fake_provider:make", 16, 8, 80, path=(fake_module,),
                               imports=("numpy",))
    big = memory.step_memory("fake_provider:make", 16, 8, 208, path=(fake_module,),
                             imports=("numpy",))
    assert big.step_extra_mb - small.step_extra_mb == pytest.approx(128, abs=6)
    assert big.state_mb == pytest.approx(small.state_mb, abs=6)


def test_failing_child_gives_its_error(fake_module):
    with pytest.raises(memory.StepMemoryError, match="(?s)fake_provider:broken.*no model of size 7"):
        memory.step_memory("fake_provider:broken", 7, path=(fake_module,))
    with pytest.raises(memory.StepMemoryError, match="(?s)step_fails.*step ran out"):
        memory.step_memory("fake_provider:step_fails", path=(fake_module,))
    with pytest.raises(memory.StepMemoryError, match="has no function 'nothing'"):
        memory.step_memory("fake_provider:nothing", path=(fake_module,))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="factory must be 'module:function'"):
        memory.step_memory("no_colon")
    with pytest.raises(ValueError, match="JSON"):
        memory.step_memory("fake_provider:make", object())


# Page faults of a loop that allocates, touches and frees a 2 MiB block (512 pages; under the
# 4 MiB from which numpy asks for huge pages), in a process whose allocator is as the harness
# leaves it there; and how many times importing the harness called glibc's mallopt.
FAULTS = textwrap.dedent("""
    import resource

    import numpy as np

    def faults(blocks):
        import ctypes

        import torch  # noqa: F401  (imported before the spy: it loads libraries through ctypes)

        calls = []  # the functions of a library loaded through ctypes that harness's import uses

        class Spy:
            def __init__(self, lib):
                self.lib = lib

            def __getattr__(self, name):
                calls.append(name)
                return getattr(self.lib, name)

        real = ctypes.CDLL
        ctypes.CDLL = lambda *args, **kwargs: Spy(real(*args, **kwargs))
        try:
            import harness
        finally:
            ctypes.CDLL = real

        np.ones(2 * 2**20, dtype=np.uint8)  # one freed block of this size first
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(blocks):
            np.ones(2 * 2**20, dtype=np.uint8)
        pages = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return {"allocator": harness.ALLOCATOR, "fixed": harness.MALLOC_FIXED,
                "words": harness.allocator_words(), "mallopt": calls.count("mallopt"),
                "faults": pages}

    def echo(*args, **kwargs):
        return {"args": list(args), "kwargs": kwargs}
""")


@pytest.fixture()
def faults_module(tmp_path):
    (tmp_path / "fake_faults.py").write_text(FAULTS)
    return str(tmp_path)


def test_call_fresh_returns_the_result_and_names_failures(fake_module, faults_module):
    got = memory.call_fresh("fake_faults:echo", 1, [2, "x"], path=(faults_module,), k=None)
    assert got == {"args": [1, [2, "x"]], "kwargs": {"k": None}}
    with pytest.raises(memory.FreshProcessError, match="(?s)my case: .*no model of size 3"):
        memory.call_fresh("fake_provider:broken", 3, path=(fake_module,), label="my case")
    with pytest.raises(memory.FreshProcessError, match="has no function 'nothing'"):
        memory.call_fresh("fake_provider:nothing", path=(fake_module,))
    with pytest.raises(ValueError, match="function must be 'module:function'"):
        memory.call_fresh("fake_provider")
    with pytest.raises(ValueError, match="my case: arguments must be JSON"):
        memory.call_fresh("fake_faults:echo", {1, 2}, label="my case")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_allocator_setting_reaches_the_fresh_process(faults_module, monkeypatch):
    """By default (no RAG_FAST_BENCH_ALLOCATOR) the harness leaves glibc's allocator as it is, as
    a user's process runs: no mallopt at import, and its adaptive threshold reuses a freed 2 MiB
    block (next to no faults); RAG_FAST_BENCH_ALLOCATOR=fixed maps every block of 1 MiB or more
    fresh (each 2 MiB block faults its 512 pages in again)."""
    import harness

    monkeypatch.delenv(harness.ALLOCATOR_ENV, raising=False)
    unset = memory.call_fresh("fake_faults:faults", 20, path=(faults_module,))
    fixed = memory.call_fresh("fake_faults:faults", 20, path=(faults_module,),
                              env={harness.ALLOCATOR_ENV: "fixed"})
    default = memory.call_fresh("fake_faults:faults", 20, path=(faults_module,),
                                env={harness.ALLOCATOR_ENV: "default"})
    assert (unset["allocator"], unset["fixed"], unset["mallopt"]) == ("default", False, 0)
    assert unset["words"] == "glibc default"
    assert (fixed["allocator"], fixed["fixed"], fixed["mallopt"]) == ("fixed", True, 2)
    assert fixed["words"] == "glibc, 1 MiB mmap threshold"
    assert (default["allocator"], default["fixed"], default["mallopt"]) == ("default", False, 0)
    pages = 20 * 2 * 2**20 // 4096
    assert fixed["faults"] >= 0.9 * pages
    assert default["faults"] < 0.1 * pages and unset["faults"] < 0.1 * pages
    with pytest.raises(memory.FreshProcessError, match="RAG_FAST_BENCH_ALLOCATOR must be 'fixed' "
                                                       "or 'default', got 'sometimes'"):
        memory.call_fresh("fake_faults:faults", 1, path=(faults_module,),
                          env={harness.ALLOCATOR_ENV: "sometimes"})
