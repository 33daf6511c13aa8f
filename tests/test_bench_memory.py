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
