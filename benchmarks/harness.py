"""The one benchmark harness: timing, peak memory, machine description, tables and JSON.

A ``bench_*.py`` module only builds inputs and the competing providers, then calls
:func:`measure` for each and returns :class:`Row` objects. The harness times each provider
(median of several runs after warm-up), measures its peak extra memory, and reports ratios
against the row's baseline measured in the same run.

Statistics: every provider is timed ``ctx.repeats`` (>= 5) times after ``ctx.warmup`` untimed
runs; a row keeps every run (``runs_ms``), reports the median and the spread ``(max - min) /
median``, and is flagged noisy when the spread exceeds ``NOISY_SPREAD`` (20%). A ratio between
two providers (:func:`add_ratio`) is flagged as well when either side is noisy or when their
ranges of runs overlap, so a table never shows a speedup (or a slowdown) that the machine's
noise could explain without saying so.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` above the allocation before the call;
on the CPU, the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) above
the resident set before the call, so it counts every allocator, not only torch's. Right before
it reads that resident set, the harness has glibc return its free memory to the kernel
(``malloc_trim(0)``: the top of every arena's heap and, by ``madvise``, every free page inside
them), so the resident set holds only live memory and every page the call touches counts,
including blocks glibc would reuse from its heap (by default it keeps freed blocks of up to
32 MiB there for reuse).

Allocator: every bench times every provider with glibc's allocator as it is by default, as a
user's process runs (its adaptive mmap threshold: once a mapped block of up to 32 MiB was freed,
blocks of that size come from memory the process already holds). A process started with
``RAG_FAST_BENCH_ALLOCATOR=fixed`` in its environment fixes glibc's mmap threshold at 1 MiB
instead (which also turns off the adaptive threshold): every block of 1 MiB or more is mapped
fresh and unmapped on free, each fresh page zeroed by the kernel at its first touch, which costs
time. That is an instrument for memory, not how a user's process runs: only the training
bench's fresh memory processes (``benchmarks/memory.py``) use it, and no bench times with it.
``run.py`` records in every row the allocator its times were taken with
(``extra["allocator"]``: :func:`allocator_words`, or the training bench's own).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch


def _fix_malloc_mmap_threshold(threshold: int = 1 << 20) -> bool:
    """Make glibc map (and unmap) every allocation of ``threshold`` bytes or more."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
        return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(
            libc.mallopt(m_trim_threshold, threshold)
        )
    except (OSError, AttributeError):  # not glibc
        return False


ALLOCATOR_ENV = "RAG_FAST_BENCH_ALLOCATOR"  # "fixed": the 1 MiB mmap threshold (memory only)
# how a row names each setting (``extra["allocator"]``)
ALLOCATOR_WORDS = {"default": "glibc default", "fixed": "glibc, 1 MiB mmap threshold"}
# how a caption names the setting of a file's rows: for their times, and for their memory
ALLOCATOR_CAPTION = {
    "glibc default": "glibc's allocator as it is by default, as in a user's process",
    "glibc, 1 MiB mmap threshold": "glibc made to unmap freed blocks of 1 MiB or more (every "
                                   "large temporary fresh pages, which the kernel zeroes)",
}
MEMORY_CAPTION = {
    "glibc default": "glibc's free memory returned to the kernel first by `malloc_trim`, so "
                     "that every page the call touches counts",
    "glibc, 1 MiB mmap threshold": "glibc made to unmap freed blocks of 1 MiB or more",
}


def allocator_setting(variable: str = ALLOCATOR_ENV, default: str = "default") -> str:
    """``"fixed"`` or ``"default"`` from the environment variable ``variable``."""
    value = os.environ.get(variable, default)
    if value not in ("fixed", "default"):
        raise ValueError(f"{variable} must be 'fixed' or 'default', got {value!r}")
    return value


ALLOCATOR = allocator_setting()
MALLOC_FIXED = _fix_malloc_mmap_threshold() if ALLOCATOR == "fixed" else False


def allocator_words() -> str:
    """The allocator this process times with, as a row records it (``extra["allocator"]``)."""
    return ALLOCATOR_WORDS["fixed" if MALLOC_FIXED else "default"]


def stamp_allocator(rows: list[Row], words: str | None = None) -> list[Row]:
    """Record in each row that lacks it the allocator its times were taken with (``words``,
    default: this process's, :func:`allocator_words`); a bench that times elsewhere (the
    training bench's fresh processes) sets its rows' own. Returns ``rows``."""
    words = words or allocator_words()
    for row in rows:
        row.extra.setdefault("allocator", words)
    return rows


def allocator_caption(rows: list[dict], memory: bool = False,
                      before: str = ALLOCATOR_WORDS["fixed"]) -> str:
    """How a caption says the allocator a results file's rows were timed with (``memory``: how
    their peak memory was measured in it), from their ``extra["allocator"]``; ``before`` for
    rows that predate the field (until then the harness timed every bench but the training one
    with the fixed threshold). Several settings (never the case in one run) joined by "and"."""
    words = sorted({r.get("extra", {}).get("allocator", before) for r in rows} or {before})
    table = MEMORY_CAPTION if memory else ALLOCATOR_CAPTION
    return " and ".join(table.get(w, w) for w in words)


_MALLOC_TRIM = None  # glibc's malloc_trim, once looked up; False where there is none


def _malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: the free memory of every arena back to the kernel (the top
    of each heap, and every whole free page inside it by ``madvise``). False without glibc."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        name = ctypes.util.find_library("c")
        try:
            _MALLOC_TRIM = ctypes.CDLL(name).malloc_trim if name else False
        except (OSError, AttributeError):  # not glibc
            _MALLOC_TRIM = False
        if _MALLOC_TRIM:
            _MALLOC_TRIM.argtypes, _MALLOC_TRIM.restype = [ctypes.c_size_t], ctypes.c_int
    if not _MALLOC_TRIM:
        return False
    _MALLOC_TRIM(0)
    return True


NOISY_SPREAD = 0.20  # a measurement whose (max - min) / median exceeds this is flagged noisy


def _quantile(sorted_times: list[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list (numpy's default method)."""
    pos = (len(sorted_times) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_times) - 1)
    return sorted_times[lo] + (sorted_times[hi] - sorted_times[lo]) * (pos - lo)


@dataclass
class Measurement:
    """Timed runs of one provider: the median and the spread of ``times_ms``."""

    median_ms: float
    min_ms: float
    runs: int
    peak_mb: float | None
    times_ms: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, times_ms: list[float], peak_mb: float | None = None) -> "Measurement":
        if not times_ms:
            raise ValueError("Measurement.of: times_ms is empty (no timed run)")
        return cls(statistics.median(times_ms), min(times_ms), len(times_ms), peak_mb,
                   list(times_ms))

    @property
    def max_ms(self) -> float:
        return max(self.times_ms) if self.times_ms else self.median_ms

    @property
    def q1_ms(self) -> float:
        return _quantile(sorted(self.times_ms), 0.25) if self.times_ms else self.median_ms

    @property
    def q3_ms(self) -> float:
        return _quantile(sorted(self.times_ms), 0.75) if self.times_ms else self.median_ms

    @property
    def spread(self) -> float:
        """(max - min) / median of the timed runs: 0.1 means the runs lie within 10% of it."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms > 0 else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD


@dataclass
class Row:
    """One line of a table: a provider measured on a case, with ratios to the case baseline."""

    bench: str
    case: str
    provider: str
    median_ms: float
    peak_mb: float | None
    extra: dict = field(default_factory=dict)  # e.g. {"speedup": 12.3, "GB/s": 4.1}
    runs_ms: list[float] = field(default_factory=list)  # every timed run, for the spread
    spread: float | None = None  # (max - min) / median of runs_ms
    noisy: list[str] = field(default_factory=list)  # why the row is flagged: "timing", ratio keys

    @classmethod
    def of(cls, bench: str, case: str, provider: str, m: Measurement,
           extra: dict | None = None) -> "Row":
        """A row from a measurement: its median, peak memory, runs and spread; flagged noisy
        when the runs spread by more than ``NOISY_SPREAD`` of the median."""
        return cls(bench, case, provider, m.median_ms, m.peak_mb, dict(extra or {}),
                   list(m.times_ms), m.spread if m.times_ms else None,
                   ["timing"] if m.noisy else [])


def ratio_is_noisy(base: Measurement, m: Measurement) -> bool:
    """A ratio of two medians is not trusted when either side is noisy, or when the two
    measurements' [min, max] ranges overlap (some run of the slower beat some run of the
    faster): the ratio is then within the machine's noise."""
    if base.noisy or m.noisy:
        return True
    return not (base.max_ms < m.min_ms or m.max_ms < base.min_ms)


def add_ratio(row: Row, key: str, base: Measurement, m: Measurement) -> float:
    """``row.extra[key] = base.median / m.median`` (> 1: ``m`` is faster), flagging ``key`` in
    ``row.noisy`` when :func:`ratio_is_noisy`. A ratio to itself (the baseline's own row) is
    1.0 and never flagged."""
    value = base.median_ms / m.median_ms
    row.extra[key] = value
    if base is not m and ratio_is_noisy(base, m) and key not in row.noisy:
        row.noisy.append(key)
    return value


@dataclass
class Context:
    device: str
    quick: bool
    repeats: int
    warmup: int
    # the most threads each process of the bench may run (None: the bench's own choice); run.py
    # sets it when it retries a bench that could not start a thread or process
    threads: int | None = None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_mb(fn: Callable[[], object], device: str) -> float | None:
    """Peak extra memory (MB) of one call of ``fn``, beyond what was allocated before it.

    CPU: the peak resident set during the call above the resident set before it, after glibc
    returned its free memory to the kernel (:func:`_malloc_trim`), so that a block the call
    reuses from glibc's heap (or from rag_fast's buffer pool, emptied first) counts too."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del result
        return peak / 2**20
    if "rag_fast" in sys.modules:  # memory its buffer pool keeps idle would hide a call's peak
        sys.modules["rag_fast"].empty_cache()
    _malloc_trim()  # free heap pages are not resident: every page the call touches counts
    if not _reset_peak_rss():
        return None
    before = _rss_kb("VmRSS")
    result = fn()
    peak = _rss_kb("VmHWM")
    del result
    if before is None or peak is None:
        return None
    return max(peak - before, 0) / 1024


def measure(fn: Callable[[], object], ctx: Context, memory: bool = True) -> Measurement:
    """Time ``fn`` (median of ``ctx.repeats`` runs after ``ctx.warmup``) and its peak memory."""
    for _ in range(ctx.warmup):
        fn()
    _sync(ctx.device)
    times = []
    for _ in range(ctx.repeats):
        start = time.perf_counter()
        fn()
        _sync(ctx.device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = peak_memory_mb(fn, ctx.device) if memory else None
    return Measurement.of(times, peak)


def measure_interleaved(
    fns: dict[str, Callable[[], object]],
    ctx: Context,
    memory: bool = True,
    before_memory: dict[str, Callable[[], object]] | None = None,
) -> dict[str, Measurement]:
    """:func:`measure` for several providers whose timed runs alternate (a, b, a, b, ...), so
    that a machine whose speed drifts during a slow benchmark slows every provider alike.

    ``before_memory[name]``, if given, runs before that provider's peak-memory call: it drops
    what the provider keeps between calls (a reused buffer), so that the peak counts it.
    """
    for _ in range(ctx.warmup):
        for fn in fns.values():
            fn()
    _sync(ctx.device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ctx.repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync(ctx.device)
            times[name].append((time.perf_counter() - start) * 1e3)
    out = {}
    for name, fn in fns.items():
        peak = None
        if memory:
            if before_memory and name in before_memory:
                before_memory[name]()
            peak = peak_memory_mb(fn, ctx.device)
        out[name] = Measurement.of(times[name], peak)
    return out


# Environment variables that cap the instruction set each library uses, so that one CPU can stand
# in for an older one (docs/benchmarks.md, "Other machines"): rag_fast's kernels, torch's own
# kernels, MKL (BLAS) and oneDNN. Recorded in the machine description when set.
ISA_CAP_VARIABLES = ("RAG_FAST_SIMD", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                     "ONEDNN_MAX_CPU_ISA")


def machine_description(device: str) -> dict:
    """What the numbers were measured on."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    try:  # the instruction set torch's own CPU kernels were dispatched to
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        pass
    caps = {k: os.environ[k] for k in ISA_CAP_VARIABLES if os.environ.get(k)}
    if caps:
        info["isa_caps"] = caps
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        from rag_fast import _ext

        if _ext.available():
            info["rag_fast_simd"] = _ext.get().simd_level()
            info["rag_fast_threads"] = _ext.get().num_threads()
    except Exception:  # the harness must run even if rag_fast is broken
        pass
    try:
        from rag_fast import _pool
    except ImportError:
        pass
    else:  # a bad RAG_FAST_POOL_MB raises here, before any bench runs
        info["rag_fast_pool_mb"] = _pool.limit_bytes() >> 20  # 0: the CPU buffer pool off
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def markdown_table(rows: list[Row]) -> str:
    """Rows as one Markdown table; extra columns are the union of the rows' ``extra`` keys."""
    extra_keys: list[str] = []
    for r in rows:
        for k, v in r.extra.items():
            if k not in extra_keys and not isinstance(v, (list, dict)):  # curves: plotted, not tabled
                extra_keys.append(k)
    head = ["bench", "case", "provider", "median ms", "spread", "peak MB", *extra_keys, "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.bench, r.case, r.provider, f"{r.median_ms:.3f}",
                 "-" if r.spread is None else f"{r.spread:.0%}",
                 "-" if r.peak_mb is None else f"{r.peak_mb:.1f}"]
        for k in extra_keys:
            v = r.extra.get(k, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        cells.append(noisy_note(r.noisy))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_command(args: dict) -> str:
    """The ``run.py`` command line of the run whose ``args`` a results file records."""
    parts = ["python benchmarks/run.py", "--quick" if args.get("quick", False) else "--full"]
    parts += [f"--only {name}" for name in args.get("only") or []]
    if args.get("device", "cpu") != "cpu":
        parts.append(f"--device {args['device']}")
    if args.get("repeats"):
        parts.append(f"--repeats {args['repeats']}")
    if args.get("out"):
        parts.append(f"--out {args['out']}")
    return " ".join(parts)


def source_path(source: str) -> str:
    """Where a caption says its results file is: a bare file name is a committed one (under
    ``benchmarks/results/``), a path (``render.py FILE``, ``run.py``) is shown as given."""
    return source if "/" in source or os.sep in source else f"benchmarks/results/{source}"


def machine_words(m: dict) -> str:
    """A results file's machine as README captions name it: CPU, cores, SIMD level, torch."""
    simd = f", rag_fast {m['rag_fast_simd']}" if m.get("rag_fast_simd") else ""
    words = f"{m['cpu']}, {m['cpu_count']} cores{simd}, torch {m['torch'].split('+')[0]}"
    caps = m.get("isa_caps")
    if caps:
        words += " (instruction sets capped: " + ", ".join(
            f"`{k}={v}`" for k, v in sorted(caps.items())) + ")"
    return words


def spread_cell(row: dict | None) -> str:
    """A saved row's spread as a table cell; "-" for no row, or a row without timed runs."""
    return "-" if row is None or row.get("spread") is None else f"{row['spread']:.0%}"


def runs_counted(rows: list[dict]) -> str:
    """How many timed runs the saved rows hold, in words: "5", "5 to 10" or "several"."""
    runs = sorted({len(r["runs_ms"]) for r in rows if r.get("runs_ms")})
    if not runs:
        return "several"
    return f"{runs[0]}" if len(runs) == 1 else f"{runs[0]} to {runs[-1]}"


def noisy_note(flags: list[str]) -> str:
    """The table note of a row's noisy flags: '' or e.g. 'noisy (timing, speedup)'."""
    return f"noisy ({', '.join(flags)})" if flags else ""


def profile_tables(rows: list[dict], groups: tuple[str, ...], time_key: str, time_words: str,
                   columns: tuple[tuple[str, Callable[[dict], str]], ...] = ()) -> list[str]:
    """A profile's Markdown: one table per case of ``rows`` (each a provider's profiled call
    or step: ``case``, ``provider``, ``time_key`` ms, ``groups`` ms, ``gemm_floor_ms``,
    ``gemm_gflops``), a line per provider with its time over the case's GEMM floor and its
    ``groups`` in ms; ``columns``: (header, cell of a row) pairs after the provider's name."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        here = [r for r in rows if r["case"] == case]
        floor = here[0]["gemm_floor_ms"]
        out.append(f"\n{case} (GEMM floor {floor:,.0f} ms at {here[0]['gemm_gflops']:,.0f} "
                   "GFLOP/s):\n")
        heads = ["provider", *(h for h, _ in columns), time_words, "x floor", *groups]
        out.append("| " + " | ".join(heads) + " |")
        out.append("|---" * len(heads) + "|")
        for r in here:
            cells = [r["provider"], *(cell(r) for _, cell in columns), f"{r[time_key]:,.0f}",
                     f"{r[time_key] / floor:.2f}x", *(f"{r['groups'][g]:,.0f}" for g in groups)]
            out.append("| " + " | ".join(cells) + " |")
    return out


def write_json(path: str, rows: list[Row], machine: dict, args: dict,
               load: dict | None = None, failed: dict[str, str] | None = None) -> None:
    """Write the results atomically (temp file + rename); ``load``: the machine's load during
    each bench (:class:`LoadMonitor`), under the file's ``"load"`` key; ``failed``: the benches
    that failed, each with its error (so without rows), under ``"failed"`` when there are any."""
    payload = {"machine": machine, "args": args, "rows": [asdict(r) for r in rows]}
    if load is not None:
        payload["load"] = load
    if failed:
        payload["failed"] = failed
    write_json_file(path, payload)


def write_json_file(path: str, payload, indent: int = 2) -> None:
    """``payload`` as JSON at ``path``, atomically: a temp file beside it (removed if the write
    fails), flushed to disk, then renamed over ``path``; the folder is made if missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _cpu_busy_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (rag_fast's own reading of
    /proc/stat, which its thread policy uses too); None without /proc/stat."""
    from rag_fast._threads import machine_busy_s

    return machine_busy_s()


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the benches' fresh
    processes and ranks are waited for before a bench returns)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a process from /proc/PID/stat; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the command's ")": state, ppid, ..., utime (12th), stime (13th)
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int] | None:
    """The child pids of ``pid`` from /proc/PID/task/*/children (a few small files: the
    polling stays cheap however many processes the machine runs); None where the kernel has
    no such files."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            return None
        except OSError:
            continue
    return found


def _tree(root: int) -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds) of every process below ``root``: walked through the
    children files, or from a scan of all of /proc where those are missing."""
    table, todo = {}, [root]
    while todo:
        children = _children(todo.pop())
        if children is None:  # no children files: every process, then keep root's subtree
            every = {}
            for name in os.listdir("/proc"):
                if name.isdigit() and (st := _stat(int(name))) is not None:
                    every[int(name)] = st
            return {pid: every[pid] for pid in _descendants(every, root)}
        for child in children:
            if child not in table and (st := _stat(child)) is not None:
                table[child] = st
                todo.append(child)
    return table


def _descendants(table: dict[int, tuple[int, float]], root: int) -> set[int]:
    """The pids below ``root`` in a pid -> (parent pid, ...) table."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class LoadMonitor:
    """The machine's load while a bench ran: ``with LoadMonitor() as m: ...`` then ``m.result``,
    a JSON dict:

    - ``"seconds"``: the bench's wall time;
    - ``"other_cores"``: the CPU time every other process used over that time, in cores (the
      machine's busy time from /proc/stat less the run's own: this process's, its ended
      children's, and that of the processes below it still running or not waited for by this
      process, such as ranks a forkserver started, seen by polling /proc every ``poll_s``
      seconds; None without /proc/stat): 0 on an idle machine, 1 when another process kept
      one core busy throughout. A descendant that lived less than ``poll_s`` between two polls
      and was not this process's child counts as another process's, and so does every such
      descendant when the polling thread could not start (a machine out of threads);
    - ``"load_avg"``: the 1-minute load average at the end (it counts this run's own threads).
    """

    def __init__(self, poll_s: float = 0.25) -> None:
        self.poll_s = poll_s

    def _poll(self) -> None:
        me = os.getpid()
        while True:
            for pid, (ppid, cpu) in _tree(me).items():
                if ppid == me:
                    continue  # this process's children: counted when it waits for them
                first, _ = self._tree.get(pid, (None, None))
                self._tree[pid] = (cpu if first is None else first, cpu)
            if self._stop.wait(self.poll_s):
                return

    def __enter__(self) -> "LoadMonitor":
        import threading

        self._wall, self._busy, self._own = time.perf_counter(), _cpu_busy_s(), _own_cpu_s()
        self.result: dict = {}
        # descendant pid -> (CPU s when first seen, when last seen); a pid new since the start
        # counts from 0 (its first sighting may be late)
        self._tree: dict[int, tuple[float, float]] = {}
        self._existing = {pid: cpu for pid, (_, cpu) in _tree(os.getpid()).items()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = threading.Thread(target=self._poll, daemon=True)
        try:
            self._thread.start()
        except RuntimeError:  # can't start new thread: the bench still runs, and says why if
            self._thread = None  # it cannot either; processes below it count as others'
        return self

    def _tree_cpu_s(self) -> float:
        """CPU seconds the descendants that are not this process's children used meanwhile."""
        return sum(last - self._existing.get(pid, 0.0) for pid, (_, last) in self._tree.items())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        wall = max(time.perf_counter() - self._wall, 1e-9)
        busy = _cpu_busy_s()
        others = None
        if busy is not None and self._busy is not None:
            own = _own_cpu_s() - self._own + self._tree_cpu_s()
            others = max(0.0, (busy - self._busy) - own) / wall
        self.result = {"seconds": round(wall, 1),
                       "other_cores": None if others is None else round(others, 2),
                       "load_avg": round(os.getloadavg()[0], 2)}


# what the number beside a curve's point is, by preset (a row may name it: extra["curve setting"])
CURVE_SETTINGS = {"ivfpq": "nprobe", "hnsw": "ef_search", "ivf": "nprobe"}


def curve_setting(row: Row) -> str:
    """The search setting a row's curve points are labelled with (``nprobe``, ``ef_search``)."""
    named = row.extra.get("curve setting")
    if named:
        return str(named)
    for preset, setting in CURVE_SETTINGS.items():
        if row.provider.endswith(preset):
            return setting
    return "setting"


def plot_curves(rows: list[Row], path: str) -> bool:
    """One recall/throughput panel per data set of the rows whose ``extra`` has a ``curve``
    (``[setting, recall, queries/s]`` points), with exact search as a horizontal line; PNG at
    ``path``. Each point is labelled with its setting, in its curve's colour, and the legend
    names the setting (:func:`curve_setting`); a label that would overlap the one placed before
    it (within 14 pixels) is left out. Returns False when no row has a curve."""
    curves = [r for r in rows if r.extra.get("curve")]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in curves))
    providers = list(dict.fromkeys(r.provider for r in curves))  # one colour each, in every panel
    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 4.4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        mine = [r for r in curves if r.case == case]
        low = min(p[1] for r in mine for p in r.extra["curve"])
        ax.set_xlim(max(0.0, low - 0.02), 1.002)
        ax.set_yscale("log")
        for r in mine:
            pts = r.extra["curve"]
            color = f"C{providers.index(r.provider)}"
            ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", color=color,
                    label=f"{r.provider} (point labels: {curve_setting(r)})")
        exact = [r.extra["QPS"] for r in rows if r.case == case and "exact" in r.provider
                 and "QPS" in r.extra and not r.extra.get("curve")]
        if exact:
            ax.axhline(max(exact), color="gray", linestyle="--", label="exact search (fastest)")
        ax.set_ylim(*ax.get_ylim())  # fixed, so that display positions hold for the labels
        placed = []
        for r in mine:
            color = f"C{providers.index(r.provider)}"
            for i, p in enumerate(r.extra["curve"]):
                x, y = ax.transData.transform((p[1], p[2]))
                if any(abs(x - px) < 14 and abs(y - py) < 14 for px, py in placed):
                    continue
                placed.append((x, y))
                ax.annotate(str(p[0]), (p[1], p[2]), fontsize=7, color=color,
                            xytext=(-4, 6) if i % 2 else (4, -11), textcoords="offset points")
        ax.set_xlabel("recall@10 against exact search")
        ax.set_ylabel("queries/s (batches of 128)")
        ax.set_title(case, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.tmp.{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return True
