"""How many CPU threads rag_fast's kernels and torch's CPU ops use, and a watch on step times.

torch and rag_fast's C++ kernels run on one OpenMP runtime (torch's ``libgomp``, loaded before
the extension, which then binds to it), so one setting covers both: :func:`set_threads` calls
``torch.set_num_threads``, which sets OpenMP's team size for every later parallel region,
rag_fast's included. ``RAG_FAST_THREADS=N`` applies it when rag_fast is imported; the
``rag-fast`` commands take ``--threads N`` (which wins over the variable).

Why it matters: an OpenMP parallel region ends at a barrier that waits for every thread of the
team. On a machine whose cores are all busy with another process, one of the team's threads is
often descheduled, and the others wait for it at every barrier, a time slice at a time: a
training step of many small operations then slows far more than its share of the CPU says
(docs/tuning.md, "Threads on a shared machine", has the measurements).

:class:`SlowStepWatch` notices when steps become much slower than the first ones, so that the
training loop can say so once.
"""
from __future__ import annotations

import collections
import os
import re
import resource
import statistics
import sys
import time

ENV = "RAG_FAST_THREADS"
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # OpenMP's, read once when it loads
BUSY_CORES = 0.5  # other processes' use, in cores, from which the machine counts as busy
COMMAND_POLICY: str | None = None  # what command_wait_policy() set in this process, if anything


PER_CORE = 4  # threads per usable core a count may ask for (more only adds barrier waits)
SPARE_TASKS = 32  # tasks left free under a process limit for the rest of the program


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` without one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cgroup_tasks_left() -> int | None:
    """Tasks (processes and threads) this process's cgroup may still start (cgroup v2's
    ``pids.max`` less ``pids.current``), or None where no such limit is set or readable."""
    try:
        with open("/proc/self/cgroup") as f:
            line = next((ln for ln in f if ln.startswith("0::")), None)
        if line is None:
            return None
        folder = os.path.join("/sys/fs/cgroup", line[3:].strip().lstrip("/"))
        with open(os.path.join(folder, "pids.max")) as f:
            most = f.read().strip()
        if most == "max":
            return None
        with open(os.path.join(folder, "pids.current")) as f:
            return int(most) - int(f.read().strip())
    except (OSError, ValueError):
        return None


def _nproc_tasks_left() -> int | None:
    """Tasks the user may still start under ``RLIMIT_NPROC`` (counting every task on the
    machine, /proc/loadavg's total, as the user's: an under-estimate, never an over-estimate),
    or None where the limit is unset or not enforced (root)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft == resource.RLIM_INFINITY or os.geteuid() == 0:
        return None
    try:
        with open("/proc/loadavg") as f:
            tasks = int(f.read().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return None
    return soft - tasks


def thread_bound() -> tuple[int, str]:
    """The most threads a count may ask for, and why: :data:`PER_CORE` per usable core,
    and no more than the process limits leave (``RLIMIT_NPROC``, the cgroup's ``pids.max``,
    less :data:`SPARE_TASKS`), at least 1. OpenMP aborts the process (or hangs it) when it
    cannot start a team's threads, so a count is checked before any thread is started."""
    cores = usable_cores()
    most, why = PER_CORE * cores, f"{PER_CORE} per core on {cores} usable core(s)"
    for left, limit in ((_nproc_tasks_left(), "RLIMIT_NPROC"),
                        (_cgroup_tasks_left(), "the cgroup's pids.max")):
        if left is not None and left - SPARE_TASKS < most:
            most = max(1, left - SPARE_TASKS)
            why = f"{limit} leaves room for {max(0, left)} more tasks"
    return most, why


def threads_from_env() -> int | None:
    """``RAG_FAST_THREADS`` as a thread count, or None when unset or empty.

    Raises:
        ValueError: a value that is not a whole number >= 1, or above :func:`thread_bound`,
            naming the variable.
    """
    raw = os.environ.get(ENV)
    if raw is None or raw.strip() == "":
        return None
    if not re.fullmatch(r"[0-9]+", raw.strip()) or int(raw) < 1:
        raise ValueError(f"{ENV} must be a whole number of threads >= 1, got {raw!r}")
    return check_threads(int(raw), ENV)


def check_threads(n, name: str = "threads") -> int:
    """``n`` as a thread count: a whole number from 1 to :func:`thread_bound`.

    Raises:
        ValueError: naming ``name``, the value and the bound.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a whole number of threads >= 1, got {n!r}")
    most, why = thread_bound()
    if n > most:
        raise ValueError(f"{name} {n} is more threads than this machine allows: at most "
                         f"{most} ({why})")
    return n


def set_threads(n: int) -> None:
    """Use ``n`` threads for torch's CPU ops and rag_fast's kernels from now on (one OpenMP
    team size for both; see the module's docstring)."""
    import torch

    torch.set_num_threads(check_threads(n))


def get_threads() -> int:
    """The thread count torch's CPU ops and rag_fast's kernels use now."""
    import torch

    return torch.get_num_threads()


def apply_env() -> int | None:
    """Apply ``RAG_FAST_THREADS`` if it is set; returns the count applied (None: unset).
    Raises ValueError for a bad value (see :func:`threads_from_env`)."""
    n = threads_from_env()
    if n is not None:
        set_threads(n)
    return n


def machine_busy_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (/proc/stat's first line:
    user, nice, system, irq, softirq, steal), or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 8 or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, *rest = (int(v) for v in fields[1:])
    return (user + nice + system + irq + softirq + (rest[0] if rest else 0)) / os.sysconf(
        "SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds this process (all its threads) has used."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def other_cores_now(seconds: float = 0.1) -> float | None:
    """How many cores other processes keep busy, measured over ``seconds`` (this process
    sleeps meanwhile); None without /proc/stat."""
    before, own = machine_busy_s(), own_cpu_s()
    if before is None:
        return None
    start = time.perf_counter()
    time.sleep(seconds)
    after = machine_busy_s()
    wall = time.perf_counter() - start
    if after is None:
        return None
    return max(0.0, (after - before) - (own_cpu_s() - own)) / wall


def wait_policy_for_load(environ=None, seconds: float = 0.1) -> dict[str, str]:
    """The OpenMP settings a process about to start should get on this machine now: on a
    machine other processes keep busy (:data:`BUSY_CORES` or more), ``OMP_WAIT_POLICY=PASSIVE``,
    so that threads waiting at a barrier sleep instead of spinning on cores the other
    processes need; on an idle one nothing (spinning is faster there). Nothing either when
    ``environ`` (default ``os.environ``) already sets a wait policy or spin count: the user's."""
    environ = os.environ if environ is None else environ
    if any(v in environ for v in WAIT_VARIABLES):
        return {}
    others = other_cores_now(seconds)
    return {"OMP_WAIT_POLICY": "PASSIVE"} if others is not None and others >= BUSY_CORES else {}


def is_command() -> bool:
    """Whether this process is the ``rag-fast`` command (its script, or ``python -m
    rag_fast.cli``, as torchrun may start it)."""
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    orig = list(getattr(sys, "orig_argv", []))
    modules = ("rag_fast.cli", "rag_fast.cli.__main__")
    # the module Python was told to run (`-m rag_fast.cli`, `-mrag_fast.cli`), not any argument
    # that happens to name it (`pytest --cov rag_fast.cli` is a library user's process)
    return argv0 == "rag-fast" or any(
        (a == "-m" and i + 1 < len(orig) and orig[i + 1] in modules)
        or (a.startswith("-m") and a[2:] in modules) for i, a in enumerate(orig))


def command_wait_policy() -> str | None:
    """For the ``rag-fast`` command only, before torch (and so OpenMP) loads: apply
    :func:`wait_policy_for_load` to this process's environment. Returns the policy set (also
    kept in :data:`COMMAND_POLICY`), or None. A library user's process is left as it is: its
    import order decides whether OpenMP has loaded already, and the wait policy is theirs to
    set (docs/tuning.md)."""
    global COMMAND_POLICY
    if "torch" in sys.modules or not is_command() or {"-h", "--help"} & set(sys.argv[1:]):
        return None  # (a help text computes nothing: no 0.1 s of measuring for it)
    settings = wait_policy_for_load()
    os.environ.update(settings)
    COMMAND_POLICY = settings.get("OMP_WAIT_POLICY")
    return COMMAND_POLICY


def passive_waits() -> bool:
    """Whether OpenMP threads of this process sleep at barriers (``OMP_WAIT_POLICY=PASSIVE``)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


class AutoThreads:
    """Threads chosen from what other processes leave free, re-decided between steps.

    A training loop calls :meth:`after_step` after each step. Over windows of at least
    ``min_interval`` seconds it measures how many cores other processes kept busy (the
    machine's busy time from /proc/stat less this process's own CPU time, over the wall time),
    and uses ``most - round(median of the last `window` windows)`` threads, at least 1, where
    ``most`` is the thread count it started with (torch's default: one per core). On an idle
    machine that is ``most``; beside a process that keeps both cores of a 2-core machine busy
    it is 1, which avoids the barrier waits the module's docstring describes; when the other
    process ends, the count goes back up. Without /proc/stat it changes nothing, nor when
    OpenMP's threads wait passively (:func:`passive_waits`): sleeping at barriers, all the
    threads run faster beside a busy process than one thread does (docs/tuning.md).
    """

    def __init__(self, most: int | None = None, window: int = 3,
                 min_interval: float = 0.5) -> None:
        self.most = check_threads(most if most is not None else get_threads(), "most")
        self.window, self.min_interval = window, min_interval
        self.passive = passive_waits()
        self._others: collections.deque = collections.deque(maxlen=window)
        self._mark = self._sample()
        self.threads = get_threads()
        self.changes: list[tuple[int, int]] = []  # (step, threads) at each change

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        return time.perf_counter(), machine_busy_s(), own_cpu_s()

    def other_cores(self) -> float | None:
        """The median of the last windows' other-process load, in cores (None: not yet)."""
        return statistics.median(self._others) if self._others else None

    def after_step(self, step: int = 0) -> int | None:
        """Account for the time since the last call; returns the new thread count when it
        changed, else None."""
        if self.passive:
            return None
        now = self._sample()
        wall = now[0] - self._mark[0]
        if wall < self.min_interval or now[1] is None or self._mark[1] is None:
            return None
        others = max(0.0, (now[1] - self._mark[1]) - (now[2] - self._mark[2])) / wall
        self._mark = now
        self._others.append(others)
        want = max(1, min(self.most, self.most - round(self.other_cores())))
        if want == self.threads:
            return None
        set_threads(want)
        self.threads = want
        self.changes.append((step, want))
        return want


class SlowStepWatch:
    """Says once when training steps have become much slower than the first ones.

    The reference is the median of the ``reference`` steps after the first ``skip`` (the first
    steps pay for allocation and warm-up); from then on, whenever the median of the last
    ``window`` steps exceeds ``factor`` times the reference, :meth:`observe` returns a one-line
    message, the first time only. Steps that do other work (evaluation, checkpoints) should not
    be given to it.
    """

    def __init__(self, factor: float = 3.0, skip: int = 2, reference: int = 5,
                 window: int = 5) -> None:
        if factor <= 1 or min(reference, window) < 1 or skip < 0:
            raise ValueError("SlowStepWatch needs factor > 1, reference >= 1, window >= 1, "
                             f"skip >= 0; got {factor}, {reference}, {window}, {skip}")
        self.factor, self.skip, self.reference, self.window = factor, skip, reference, window
        self._first: list[float] = []
        self._recent: list[float] = []
        self._steps = 0
        self.base: float | None = None
        self.warned = False

    def observe(self, seconds: float) -> str | None:
        """Record one step's time; the warning's text the first time steps are slow, else
        None."""
        self._steps += 1
        if self._steps <= self.skip:
            return None
        if self.base is None:
            self._first.append(seconds)
            if len(self._first) == self.reference:
                self.base = statistics.median(self._first)
            return None
        self._recent = (self._recent + [seconds])[-self.window:]
        if self.warned or len(self._recent) < self.window or self.base <= 0:
            return None
        now = statistics.median(self._recent)
        if now <= self.factor * self.base:
            return None
        self.warned = True
        return (f"training steps now take {now:.2f} s, {now / self.base:.1f}x the "
                f"{self.base:.2f} s of the first ones, on {get_threads()} thread(s): another "
                "process is probably using the CPU (docs/tuning.md, \"Threads on a shared "
                "machine\")")
