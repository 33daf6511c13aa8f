"""rag_fast.training.heap: glibc's malloc thresholds for CPU training (TrainConfig's
keep_freed_memory): what it sets, when it leaves the process alone, and what it changes."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from rag_fast.training import heap


class FakeLibc:
    def __init__(self, result: int = 1):
        self.calls, self.result = [], result

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.result


@pytest.fixture(autouse=True)
def fresh_outcome(monkeypatch):
    monkeypatch.setattr(heap, "_outcome", None)


def test_sets_both_thresholds_once():
    libc = FakeLibc()
    assert heap.keep_freed_memory({}, lambda: libc) == "set"
    assert libc.calls == [(-3, 32 << 20), (-1, 1 << 30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert heap.keep_freed_memory({}, lambda: libc) == "set" and len(libc.calls) == 2


@pytest.mark.parametrize("environ,name", [
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES"),
    ({"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=on:glibc.malloc.mmap_threshold=65536"},
     "GLIBC_TUNABLES"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"MALLOC_MMAP_THRESHOLD_": "4096"}, "MALLOC_MMAP_THRESHOLD_"),
])
def test_a_users_setting_stands(environ, name):
    libc = FakeLibc()
    assert heap.user_setting(environ) == name
    assert heap.keep_freed_memory(environ, lambda: libc) == "environment" and libc.calls == []


@pytest.mark.parametrize("environ", [
    {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"},
    {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"},
    {"MALLOC_ARENA_MAX": "2", "MALLOC_PERTURB_": "1"},
])
def test_other_malloc_settings_are_not_a_threshold(environ):
    libc = FakeLibc()
    assert heap.user_setting(environ) is None
    assert heap.keep_freed_memory(environ, lambda: libc) == "set"


@pytest.mark.parametrize("libc", [None, FakeLibc(result=0)])
def test_without_glibc_or_a_refused_setting_nothing_is_claimed(libc):
    assert heap.keep_freed_memory({}, lambda: libc) == "unavailable"


# In a fresh process (an empty environment): whether a 16 MB block is mapped afresh (glibc's
# chunk header: the size word before the block, bit 1 IS_MMAPPED), then how much free memory
# stays at the top of the heap (mallinfo2's keepcost) once five 16 MB blocks are freed. By
# default glibc maps the first such block afresh (its first mmap threshold is 128 KiB); after
# that first block is freed, its adaptive thresholds serve 16 MB blocks from the heap and trim
# the heap's top past 32 MB, so about 16 MB stays. With the thresholds set, no block is mapped
# and all 80 MB stay for reuse.
_PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from rag_fast.training import heap
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "keep":
        assert heap.keep_freed_memory() == "set"
    first = libc.malloc(16 << 20)
    mapped = bool(ctypes.c_size_t.from_address(first - ctypes.sizeof(ctypes.c_size_t)).value & 2)
    libc.free(first)
    blocks = [libc.malloc(16 << 20) for _ in range(5)]
    for block in reversed(blocks):
        libc.free(block)
    print(json.dumps({"mapped": mapped, "kept_mb": libc.mallinfo2().keepcost / 2**20}))
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_memory_stays_in_the_heap():
    def run(how: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _PROBE, how], capture_output=True,
                             text=True, timeout=120, check=True, env={"PATH": ""})
        return json.loads(out.stdout)

    default, kept = run("default"), run("keep")
    assert default["mapped"] and not kept["mapped"]
    assert default["kept_mb"] < 40 and kept["kept_mb"] >= 80, (default, kept)


def test_the_trainer_keeps_freed_memory_on_the_cpu_unless_told_not_to(monkeypatch):
    from test_training import collate, config, loss_fn, make_dataset, make_model

    from rag_fast.training import Trainer

    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(1) or "set")
    Trainer(make_model(), make_dataset(), collate, loss_fn, config(max_steps=1, warmup_steps=0)).train()
    assert calls == [1]
    Trainer(make_model(), make_dataset(), collate, loss_fn,
            config(max_steps=1, warmup_steps=0, keep_freed_memory=False)).train()
    assert calls == [1]
