"""A thread count above what the machine and the process limits allow (``--threads``,
``RAG_FAST_THREADS``, ``train.threads``, ``rag_fast.set_threads``) is refused in one line naming
the value and the bound, before OpenMP starts a thread: no hang, no signal.
"""
from __future__ import annotations

import os

import pytest

from conftest import one_line, start_command

from rag_fast import _threads


@pytest.mark.parametrize("args,env,name", [
    (["index", "info", "nothing"], {"RAG_FAST_THREADS": "100000"}, "RAG_FAST_THREADS 100000"),
    (["index", "search", "nothing", "q", "--threads", "100000"], {}, "--threads 100000"),
    (["index", "search", "nothing", "q"], {"RAG_FAST_THREADS": "20000"}, "RAG_FAST_THREADS 20000"),
])
def test_a_huge_thread_count_is_one_line_not_a_hang_or_a_signal(args, env, name):
    """The hostile pass: RAG_FAST_THREADS=100000 hung until killed, --threads 100000 ended in
    SIGSEGV, RAG_FAST_THREADS=20000 in libgomp's 'Thread creation failed'."""
    proc = start_command(*args, env=env)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 2, err
    line = one_line(err)
    assert name in line and "at most" in line, line


def test_the_bound_follows_the_cores_and_the_process_limits(monkeypatch):
    most, why = _threads.thread_bound()
    assert most == _threads.PER_CORE * _threads.usable_cores() and "per core" in why
    assert _threads.check_threads(most) == most
    with pytest.raises(ValueError, match=rf"threads {most + 1} is more .* at most {most}"):
        _threads.check_threads(most + 1)
    # an unprivileged user whose RLIMIT_NPROC leaves room for 10 more tasks: 1 thread at most
    monkeypatch.setattr(_threads, "_nproc_tasks_left", lambda: 10)
    assert _threads.thread_bound() == (1, "RLIMIT_NPROC leaves room for 10 more tasks")
    monkeypatch.setattr(_threads, "_nproc_tasks_left", lambda: None)
    monkeypatch.setattr(_threads, "_cgroup_tasks_left", lambda: _threads.SPARE_TASKS + 3)
    assert _threads.thread_bound()[0] == 3
    with pytest.raises(ValueError, match="--threads 4 .* at most 3 .*pids.max"):
        _threads.check_threads(4, "--threads")


def test_the_process_limit_is_read_for_an_unprivileged_user(monkeypatch):
    import resource

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (100000, 100000))
    with open("/proc/loadavg") as f:
        tasks = int(f.read().split()[3].split("/")[1])
    left = _threads._nproc_tasks_left()
    assert left is not None and abs(left - (100000 - tasks)) < 200
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root: the limit is not enforced
    assert _threads._nproc_tasks_left() is None


def test_every_way_to_set_a_count_checks_the_bound(monkeypatch):
    import torch

    from rag_fast.training.config import TrainConfig

    before = torch.get_num_threads()
    huge = _threads.thread_bound()[0] + 1
    with pytest.raises(ValueError, match="threads .* at most"):
        _threads.set_threads(huge)
    with pytest.raises(ValueError, match="threads .* at most"):
        TrainConfig(threads=huge)
    monkeypatch.setenv(_threads.ENV, str(huge))
    with pytest.raises(ValueError, match="RAG_FAST_THREADS .* at most"):
        _threads.threads_from_env()
    assert torch.get_num_threads() == before
