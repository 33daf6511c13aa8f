"""Threads: RAG_FAST_THREADS, set_threads, and the warning when training steps slow down."""
from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

from rag_fast import _threads
from rag_fast._threads import SlowStepWatch


def test_set_threads_sets_torch_and_the_kernels_one_team():
    before = torch.get_num_threads()
    try:
        _threads.set_threads(1)
        assert torch.get_num_threads() == 1 == _threads.get_threads()
        from rag_fast import _ext

        if _ext.available():  # one OpenMP runtime: the extension sees the same team size
            assert _ext.get().num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_a_bad_count_is_named(bad):
    with pytest.raises(ValueError, match="threads must be a whole number of threads >= 1"):
        _threads.set_threads(bad)


@pytest.mark.parametrize("raw, expected", [("1", 1), (" 3 ", 3), ("", None), (None, None)])
def test_the_variable(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv(_threads.ENV, raising=False)
    else:
        monkeypatch.setenv(_threads.ENV, raw)
    assert _threads.threads_from_env() == expected


@pytest.mark.parametrize("raw", ["0", "two", "-1", "1.5"])
def test_a_bad_variable_is_named(monkeypatch, raw):
    monkeypatch.setenv(_threads.ENV, raw)
    with pytest.raises(ValueError, match=f"RAG_FAST_THREADS must be .* got '{raw}'"):
        _threads.threads_from_env()


def test_import_applies_the_variable_and_a_bad_one_fails_before_any_work():
    code = "import rag_fast, torch; print(torch.get_num_threads())"
    env = {"PATH": "/usr/bin:/bin", "RAG_FAST_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "1"
    # a bad value is not an import error (a command could not report it in one line), and
    # RagModel refuses it before any work, as it does a bad RAG_FAST_POOL_MB
    env["RAG_FAST_THREADS"] = "lots"
    build = ("from rag_fast.testing import tiny_hf_rag; from rag_fast.models import RagModel; "
             "RagModel.from_transformers(tiny_hf_rag('token', seed=0, n_docs=2))")
    out = subprocess.run([sys.executable, "-c", code + "; " + build], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.count("\n") > 1
    assert "ValueError: RAG_FAST_THREADS must be a whole number of threads >= 1, got 'lots'" \
        in out.stderr


@pytest.mark.parametrize("argv, env, words", [
    (["tokenizer", "fit", "--passages", "p", "--vocab-size", "300", "--out", "o",
      "--threads", "0"], {}, "--threads must be a whole number of threads >= 1, got 0"),
    (["index", "info", "nothing"], {"RAG_FAST_THREADS": "two"},
     "RAG_FAST_THREADS must be a whole number of threads >= 1, got 'two'")])
def test_the_command_names_a_bad_count_in_one_line(monkeypatch, capsys, argv, env, words):
    from rag_fast.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"rag-fast: error: {words}\n"


def test_every_computing_command_takes_threads(monkeypatch):
    import argparse

    from rag_fast.cli import NO_THREADS, apply_threads, build_parser

    leaves = {}

    def walk(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                        walk(sub)
                    else:
                        leaves[sub.prog] = {s for a in sub._actions for s in a.option_strings}

    walk(build_parser())
    assert {"rag-fast train", "rag-fast eval", "rag-fast generate", "rag-fast index build",
            "rag-fast index search", "rag-fast index eval", "rag-fast tokenizer fit",
            "rag-fast init"} <= set(leaves)
    for prog, options in leaves.items():
        assert ("--threads" in options) == (prog not in NO_THREADS), prog
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("RAG_FAST_THREADS", "2")
        assert apply_threads(argparse.Namespace(threads=1)) == 1  # the flag wins
        assert torch.get_num_threads() == 1
        assert apply_threads(argparse.Namespace(threads=None)) == 2
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("RAG_FAST_THREADS")
        torch.set_num_threads(1)
        assert apply_threads(argparse.Namespace()) is None  # neither: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _steps(watch: SlowStepWatch, times):
    return [watch.observe(t) for t in times]


def test_the_watch_says_once_when_steps_are_far_slower_than_the_first_ones():
    watch = SlowStepWatch()  # skip 2, reference 5, window 5, factor 3
    said = _steps(watch, [9.0, 5.0] + [1.0] * 5 + [2.9] * 5)
    assert said == [None] * 12 and watch.base == 1.0  # the slow first two are not the reference
    said = _steps(watch, [3.5] * 2)  # the last five: 2.9, 2.9, 2.9, 3.5, 3.5: median 2.9
    assert said == [None, None]
    said = _steps(watch, [3.5, 4.0])  # 2.9, 2.9, 3.5, 3.5, 3.5: median 3.5 > 3.0
    assert said[0] is not None and said[1] is None
    # pyproject.toml's pytest filter ignores this warning by its first words: keep them
    assert said[0].startswith("training steps now take 3.50 s, 3.5x the 1.00 s of the first "
                              "ones, on ")
    assert "another process is probably using the CPU" in said[0]
    assert _steps(watch, [10.0] * 10) == [None] * 10  # once


def test_one_slow_step_is_not_enough():
    watch = SlowStepWatch()
    assert _steps(watch, [1.0] * 7 + [1.0, 1.0, 100.0, 1.0, 1.0] + [1.0] * 20) == [None] * 32


@pytest.mark.parametrize("kw", [dict(factor=1.0), dict(reference=0), dict(window=0),
                                dict(skip=-1)])
def test_bad_watch_settings(kw):
    with pytest.raises(ValueError, match="SlowStepWatch needs"):
        SlowStepWatch(**kw)


def test_the_trainer_warns_once_when_its_steps_slow_down(monkeypatch):
    """A trainer whose steps take 1 s on a fake clock, then 5 s: one SlowStepsWarning."""
    from rag_fast.training import trainer as trainer_module
    from test_training import collate, config, loss_fn, make_dataset, make_model

    clock = {"t": 0.0, "calls": 0}

    def perf_counter():
        return clock["t"]

    def slow_loss(module, batch):
        clock["calls"] += 1
        clock["t"] += 1.0 if clock["calls"] <= 10 else 5.0
        return loss_fn(module, batch)

    monkeypatch.setattr(trainer_module, "time",
                        types.SimpleNamespace(perf_counter=perf_counter, time=lambda: 0.0))
    trainer = trainer_module.Trainer(make_model(), make_dataset(), collate, slow_loss,
                                     config(max_steps=18, micro_batch_size=2, log_every=100))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    slow = [w for w in caught if issubclass(w.category, trainer_module.SlowStepsWarning)]
    assert len(slow) == 1
    assert "5.00 s, 5.0x the 1.00 s of the first ones" in str(slow[0].message)
    # tests fix RAG_FAST_THREADS (conftest): the warning says the count is fixed
    assert str(slow[0].message).endswith("the count is fixed (--threads, RAG_FAST_THREADS or "
                                         "threads in the config): unset it to adapt")


def test_auto_threads_leaves_the_cores_other_processes_use(monkeypatch):
    """AutoThreads on fake clocks: 2 threads at most; another process keeping 1.2 cores busy
    makes it 1 thread after the median of 3 windows says so; back to 2 when it is gone."""
    clock = {"wall": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(_threads.AutoThreads, "_sample",
                        staticmethod(lambda: (clock["wall"], clock["busy"], clock["own"])))
    set_to = []
    monkeypatch.setattr(_threads, "set_threads", set_to.append)
    monkeypatch.setattr(_threads, "get_threads", lambda: 2)
    auto = _threads.AutoThreads()
    assert auto.most == 2 and auto.threads == 2

    steps = iter(range(100))

    def window(others, own=2.0, wall=1.0):
        clock["wall"] += wall
        clock["own"] += own * wall
        clock["busy"] += (own + others) * wall
        return auto.after_step(next(steps))

    assert window(0.0) is None and window(0.1) is None  # idle: stays at 2
    clock["wall"] += 0.1  # a step shorter than min_interval: not a window of its own
    assert auto.after_step() is None and len(auto._others) == 2
    assert window(1.2) is None  # median of 0, 0.1, 1.2: 0.1
    assert window(1.2) == 1 and set_to == [1]  # median 1.2: leave one core
    assert window(1.3, own=1.0) is None and auto.threads == 1  # stays while the other runs
    assert window(0.0) is None  # median of 1.2, 1.3, 0: 1.2
    assert window(0.0) == 2 and set_to == [1, 2]  # gone: all the threads again
    assert auto.changes == [(3, 1), (6, 2)]  # (step, threads)


def test_auto_threads_without_proc_stat_changes_nothing(monkeypatch):
    monkeypatch.setattr(_threads, "machine_busy_s", lambda: None)
    auto = _threads.AutoThreads(most=2, min_interval=0.0)
    assert auto.after_step() is None and auto.other_cores() is None


def test_the_trainer_fixes_or_adapts_threads_and_restores_them(monkeypatch):
    from test_training import collate, config, loss_fn, make_dataset, make_model

    from rag_fast.training.trainer import Trainer

    before = torch.get_num_threads()
    seen = []

    def spy(module, batch):
        seen.append(torch.get_num_threads())
        return loss_fn(module, batch)

    try:
        torch.set_num_threads(2)
        Trainer(make_model(), make_dataset(), collate, spy, config(max_steps=2, threads=1)).train()
        assert seen == [1, 1] and torch.get_num_threads() == 2  # fixed, then restored
        monkeypatch.setenv("RAG_FAST_THREADS", "1")
        seen.clear()
        Trainer(make_model(), make_dataset(), collate, spy, config(max_steps=2)).train()
        assert seen == [1, 1] and torch.get_num_threads() == 2
        monkeypatch.delenv("RAG_FAST_THREADS")
        made = []
        real = _threads.AutoThreads
        monkeypatch.setattr(_threads, "AutoThreads", lambda: made.append(real()) or made[-1])
        Trainer(make_model(), make_dataset(), collate, spy, config(max_steps=2)).train()
        assert len(made) == 1  # neither: adaptive on the CPU
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads must be a whole number of threads >= 1, got 0"):
        config(threads=0)


def test_a_command_says_a_warning_in_one_line_and_restores_python_s_format(monkeypatch, capsys):
    import rag_fast.cli as cli
    import rag_fast.cli.runner as runner

    def warn_then_go_on(args):
        warnings.warn("steps are\n   slow", UserWarning)
        return None

    monkeypatch.setattr(runner, "apply_threads", warn_then_go_on)
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        cli.main(["index", "info", "no-such-index"])
    assert capsys.readouterr().err.splitlines()[0] == "rag-fast: warning: steps are slow"
    assert warnings.showwarning is before


@pytest.mark.parametrize("others, environ, expected", [
    (1.8, {}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    (0.5, {}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    (0.2, {}, {}),
    (None, {}, {}),  # no /proc/stat
    (1.8, {"OMP_WAIT_POLICY": "ACTIVE"}, {}),  # the user's choice stands
    (1.8, {"GOMP_SPINCOUNT": "1000"}, {})])
def test_the_wait_policy_follows_the_load(monkeypatch, others, environ, expected):
    monkeypatch.setattr(_threads, "other_cores_now", lambda seconds=0.1: others)
    assert _threads.wait_policy_for_load(environ) == expected


def test_only_the_command_sets_it_and_only_before_torch_loads(monkeypatch):
    monkeypatch.setattr(_threads, "COMMAND_POLICY", None)  # restored to None afterwards
    monkeypatch.setattr(_threads, "other_cores_now", lambda seconds=0.1: 2.0)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/rag-fast", "train"])
    assert _threads.is_command()
    assert _threads.command_wait_policy() is None  # torch is loaded in this process already
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/rag-fast", "train", "--help"])
    assert _threads.command_wait_policy() is None  # a help text: nothing to measure for
    monkeypatch.setattr(sys, "argv", ["/venv/bin/rag-fast", "train"])
    assert _threads.command_wait_policy() == "PASSIVE" == _threads.COMMAND_POLICY
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and _threads.passive_waits()
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    assert not _threads.is_command() and _threads.command_wait_policy() is None
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "rag_fast.cli", "train"])
    assert _threads.is_command()
    monkeypatch.setattr(sys, "orig_argv", ["python", "-mrag_fast.cli.__main__", "train"])
    assert _threads.is_command()
    # a process that only names the module (a library user's: coverage, a test selection)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pytest", "--cov", "rag_fast.cli"])
    assert not _threads.is_command()


def test_auto_threads_keeps_every_thread_when_threads_sleep(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    auto = _threads.AutoThreads(most=2, min_interval=0.0)
    assert auto.passive and auto.after_step() is None and auto.changes == []


def _machine_busy_s() -> float:
    """/proc/stat's busy CPU seconds, read here (not with _threads) to check it against."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            int(v) for v in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def test_the_command_measures_other_processes_not_itself():
    """A real measurement: this process is not counted (even while one of its threads keeps a
    core busy); a spinning child is."""
    import threading
    import time

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    stop = threading.Event()

    def burn():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=burn, daemon=True)
    spinner.start()
    try:
        time.sleep(0.2)  # its start-up
        machine0, own0, t0 = _machine_busy_s(), time.process_time(), time.perf_counter()
        idle = _threads.other_cores_now(1.0)
        wall = time.perf_counter() - t0
        machine = (_machine_busy_s() - machine0) / wall  # cores busy, this process included
        own = (time.process_time() - own0) / wall  # cores this process kept busy
    finally:
        stop.set()
        spinner.join()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # its start-up
        busy = _threads.other_cores_now(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert idle is not None and busy is not None
    # the spinning thread used a share of a core in the same window; the measurement is the
    # machine's busy cores less exactly that share (counted, it would be off by all of it)
    assert own > 0.2, own
    assert abs(idle - max(0.0, machine - own)) < own / 2, (idle, machine, own)
    assert busy > 0.4  # the child keeps a core busy (a share of one, on a crowded machine)
