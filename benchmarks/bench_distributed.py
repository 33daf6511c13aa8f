"""Retrieval per training step over W gloo processes on this machine: a sharded index (each
rank holds 1/W of the corpus, :class:`~rag_fast.retrieval.ShardedIndex`) against every rank
holding the whole index and searching its own questions locally.

What one step's retrieval is, per rank: a micro-batch of ``QUESTIONS`` question vectors, the
top ``K`` passages and their exact fp16 vectors (what the loss needs):

- ``sharded``: :meth:`ShardedIndex.retrieve` (collective: the queries all-gathered, every
  shard searched for all of them, results routed back and merged, the winners' vectors fetched
  from the ranks that hold them), as :class:`ShardedRetriever` runs it in a training step;
- ``full index per rank``: ``DenseIndex.search`` on the rank's own questions and a read of the
  winners' rows of ``index.embeddings``, as :class:`Retriever` does with a whole index.

Each step starts on all ranks together (a barrier, as DDP's gradient all-reduce aligns the
ranks of a training step) and lasts until the slowest rank has its passages: the step's time
is the largest of the ranks' times. A row is the median of ``ctx.repeats`` (>= 5) timed steps
after 2 warm-up steps, with their spread.

Corpus: the index bench's calibrated synthetic set (``bench_index.SyntheticSpace``: 768-d
vectors clustered by topic, questions around sub-topics the corpus does not have): 20k with --quick
(exact preset only), 200k with --full (exact and ivfpq; the ivfpq indexes, one over the whole
corpus and one per shard, are built once by the parent process and loaded by the ranks, their
fp16 vectors memory-mapped, as ``from_shards(cache=True)`` reopens them). Each rank runs
``max(1, cores // W)`` torch and faiss threads (at most ``ctx.threads``, which run.py sets when
it retries the bench with fewer threads); with more processes than cores they share the
cores (oversubscription): such a row measures the collectives' overhead on one machine, not
what W machines would do.

A rank that fails or whose process dies is seen at once (:func:`run_group` waits on every
rank's report pipe and process together), and the bench fails naming it; only a group that
hangs waits out ``TIMEOUT_S``.

Memory per rank: ``index MB`` (the search structure and the fp16 vectors of the rank's index)
and ``RSS MB`` (the rank's resident set after its timed steps: interpreter, torch, faiss and
the index; memory-mapped fp16 vectors count only for the pages a search touched); the largest
over the ranks.

:func:`render` turns a results file of this bench into a Markdown table (docs/scale.md).
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import numpy as np
from harness import (Context, Measurement, Row, add_ratio, allocator_caption, run_command,
                     source_path)

NAME = "distributed"
D, QUESTIONS, K = 768, 8, 5
WORLDS = (1, 2, 4)
SIZES = {True: (20_000, ("exact",)), False: (200_000, ("exact", "ivfpq"))}  # by ctx.quick
WARMUP = 2
TIMEOUT_S = 600  # one process group: a hang fails the bench instead of blocking the run
GRACE_S = 2.0  # after a rank failed, how long the others may take to report their own errors


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_rank(world: int, cap: int | None = None) -> int:
    """The torch and faiss threads of each of ``world`` ranks: the usable cores shared out,
    at least 1 and at most ``cap`` (``ctx.threads``) when given."""
    share = _cores() // world
    return max(1, share if cap is None else min(share, cap))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of shard ``rank`` of ``world``: as ``rag-fast index build --shard`` cuts them."""
    return n * rank // world, n * (rank + 1) // world


def _questions(topics: np.ndarray, basis: np.ndarray, rank: int, step: int) -> np.ndarray:
    import bench_index

    space = bench_index.SyntheticSpace(topics, topics[:0], basis)  # questions need no sub-topics
    return space.queries(QUESTIONS, seed=7_000_000 + 10_000 * rank + step)


def _rank(rank: int, world: int, port: int, job: dict, report: Connection) -> None:
    """One rank: join the group, open its index, time ``job['steps']`` retrieval steps on
    ``job['threads']`` threads. Sends through ``report`` rank 0's table (None from the others),
    or the traceback of its failure: a pipe, not a queue, because sending on a pipe starts no
    thread, so a rank that cannot start one can still say so."""
    try:
        import faiss
        import torch
        import torch.distributed as dist

        import rag_fast
        from rag_fast.retrieval import DenseIndex, ShardedIndex
        from rag_fast.retrieval.index import _has_inner_products

        if job.get("extension") and not _has_inner_products():
            raise RuntimeError(f"rank {rank} imported rag_fast from {rag_fast.__file__} without "
                               "the compiled kernels the parent process has: its timings would "
                               "be the fallback's")
        torch.set_num_threads(job["threads"])
        faiss.omp_set_num_threads(job["threads"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
        try:
            topics, basis = np.load(job["topics"]), np.load(job["basis"])
            n = job["passages"]
            lo, hi = _shard_bounds(n, world, rank) if job["layout"] == "sharded" else (0, n)
            if job["preset"] == "exact":
                xb = np.load(job["corpus"], mmap_mode="r")
                index = DenseIndex.build(xb[lo:hi], "exact", progress=False)
                del xb  # unmapped: the corpus file's pages leave the rank's resident set
            else:  # built once by the parent; the fp16 vectors memory-mapped
                name = f"{job['preset']}-{rank}-of-{world}" if job["layout"] == "sharded" else \
                    f"{job['preset']}-0-of-1"
                index = DenseIndex.load(os.path.join(job["dir"], name), verify=False, mmap=True)
            if job["layout"] == "sharded":
                sharded = ShardedIndex(index, lo)

                def step(q):
                    return sharded.retrieve(q, n_docs=K)
            else:
                emb = index.embeddings

                def step(q):
                    scores, ids = index.search(q, K)
                    vectors = torch.from_numpy(np.asarray(emb[ids.numpy().reshape(-1)], np.float32))
                    return scores, ids, vectors.view(len(q), K, -1)

            times = []
            for s in range(WARMUP + job["steps"]):
                q = torch.from_numpy(_questions(topics, basis, rank, s))
                dist.barrier()
                start = time.perf_counter()
                step(q)
                elapsed = time.perf_counter() - start
                if s >= WARMUP:
                    times.append(elapsed * 1e3)
            rss = _rss_mb()
            index_mb = (index.index_bytes() + 2 * index.dim * len(index)) / 2**20
            mine = torch.tensor(times + [rss, index_mb], dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
        finally:
            dist.destroy_process_group()
        value = torch.stack(every).tolist() if rank == 0 else None
    except BaseException:
        value = traceback.format_exc()
    report.send(value)


def _exit_words(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def _report(pipe: Connection, process) -> object:
    """What a rank whose pipe or process woke the wait has to say: what it sent, or, when its
    process ended without sending, a line saying so with its exit status."""
    try:
        if pipe.poll():
            return pipe.recv()
    except EOFError:  # its end of the pipe closed: the process is gone
        pass
    process.join(timeout=5)
    return f"ended without reporting ({_exit_words(process.exitcode)})"


def _collect(procs: list, pipes: list[Connection]) -> dict[int, object]:
    """rank -> its report (:func:`_report`; a ``str`` for a failure), in the order they came.
    Waits on every pipe and process together, so a rank that dies is seen when it dies; stops
    when every rank has reported, ``GRACE_S`` after the first failure (the others may wait for
    the failed rank in a collective), or after ``TIMEOUT_S``."""
    done: dict[int, object] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(done) < len(procs):
        left = [r for r in range(len(procs)) if r not in done]
        ready = wait([pipes[r] for r in left] + [procs[r].sentinel for r in left],
                     timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for r in left:
            if pipes[r] in ready or procs[r].sentinel in ready:
                done[r] = _report(pipes[r], procs[r])
        if any(isinstance(v, str) for v in done.values()):
            deadline = min(deadline, time.monotonic() + GRACE_S)
    return done


def _stop(procs: list, patience_s: float) -> None:
    """Give the rank processes ``patience_s`` in all to exit, then kill those still running."""
    end = time.monotonic() + patience_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_group(world: int, job: dict) -> list[list[float]]:
    """Run :func:`_rank` in ``world`` processes; rank 0's table: per rank, its step times (ms)
    then its RSS and index MB.

    Raises RuntimeError, as soon as a rank cannot start, fails or dies (:func:`_collect`), or
    after ``TIMEOUT_S`` without every report: its first line names the group and the cause (the
    last line of the first failed rank's traceback, its exit status, or the ranks that did not
    finish), then every failed rank's traceback follows."""
    from rag_fast.training.distributed import free_port

    ctx = multiprocessing.get_context("forkserver")
    # only torch is preloaded: the fork server starts as `python -c`, with the current folder
    # first on its path (Python 3.11 does not give it the parent's), so a rag_fast imported
    # there would be the source checkout's (no compiled extension) when run from the repository
    # root; the ranks import rag_fast themselves, with this process's path.
    ctx.set_forkserver_preload(["torch"])
    group = f"distributed bench, W={world}, {job['layout']} {job['preset']}"
    port = free_port()
    procs, pipes = [], []
    done: dict[int, object] = {}
    try:
        for r in range(world):
            pipe, send = ctx.Pipe(duplex=False)
            pipes.append(pipe)
            process = ctx.Process(target=_rank, args=(r, world, port, job, send), daemon=True)
            try:
                process.start()
            except Exception as e:
                raise RuntimeError(f"{group}: rank {r} could not start: {type(e).__name__}: {e}") from e
            finally:
                send.close()  # the rank's copy is its only one: its death closes the pipe
            procs.append(process)
        done = _collect(procs, pipes)
    finally:
        _stop(procs, patience_s=5.0 if len(done) == world else 0.0)
        for pipe in pipes:
            pipe.close()
    failed = {r: v for r, v in done.items() if isinstance(v, str)}
    missing = [r for r in range(world) if r not in done]
    if failed:
        first = next(iter(failed))
        cause = failed[first].strip().splitlines()[-1]
        raise RuntimeError(f"{group}: rank {first} failed: {cause}"
                           + "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(failed.items()))
                           + (f"\nranks {missing} stopped after it" if missing else ""))
    if missing:
        raise RuntimeError(f"{group}: ranks {missing} did not finish within {TIMEOUT_S} s")
    return done[0]


def step_bytes(world: int, n: int, k: int, d: int) -> int:
    """Bytes one rank receives in one sharded retrieval step (:meth:`ShardedIndex.retrieve`
    without a tokenizer), every rank with ``n`` questions and its winners spread evenly over
    the shards; 1/W of it comes from the rank itself. See docs/distributed.md."""
    search = 8 * 6 * world + 4 * d * world * n + 8 + 12 * k * world * n
    fetch = 8 + 8 * world + 8 * n * k + 2 * d * n * k  # flag, counts, ids asked of it, fp16 rows
    return search + fetch + 8 * world  # the tokenizer flag of retrieve()


def _build_saved(xb: np.ndarray, preset: str, where: str, worlds) -> float:
    """Build ``preset`` over the whole corpus and over every shard of ``worlds``; save each.

    faiss builds on one thread here: the builds are not timed, and faiss's OpenMP threads
    spin-wait when another process holds a core (measured on a shared 2-core machine: an
    ivfpq build of 3,000 vectors took 66 s on 2 threads, 0.6 s on one)."""
    import faiss

    from rag_fast.retrieval import DenseIndex

    start = time.perf_counter()
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        for world in sorted({1, *worlds}):
            for rank in range(world):
                lo, hi = _shard_bounds(len(xb), world, rank)
                name = os.path.join(where, f"{preset}-{rank}-of-{world}")
                if not os.path.isdir(name):
                    DenseIndex.build(xb[lo:hi], preset, progress=False).save(name)
    finally:
        faiss.omp_set_num_threads(threads)
    return time.perf_counter() - start


def run(ctx: Context) -> list[Row]:
    import bench_index

    from rag_fast.retrieval.index import _has_inner_products

    n, presets = SIZES[ctx.quick]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rag_fast_bench_distributed_") as tmp:
        space = bench_index.SyntheticSpace.for_corpus(n)
        xb = space.corpus(n)
        np.save(os.path.join(tmp, "corpus.npy"), xb)
        np.save(os.path.join(tmp, "topics.npy"), space.topics)
        np.save(os.path.join(tmp, "basis.npy"), space.basis)
        for preset in presets:
            if preset != "exact":
                _build_saved(xb, preset, tmp, WORLDS)
            base: Measurement | None = None
            for world in WORLDS:  # W=1 first: the base of "vs W=1 full"
                measured = {}
                for layout in ("full index per rank", "sharded"):
                    job = {"corpus": os.path.join(tmp, "corpus.npy"),
                           "topics": os.path.join(tmp, "topics.npy"),
                           "basis": os.path.join(tmp, "basis.npy"), "dir": tmp,
                           "preset": preset, "steps": ctx.repeats, "passages": n,
                           "layout": "sharded" if layout == "sharded" else "full",
                           "extension": _has_inner_products(),
                           "threads": threads_per_rank(world, ctx.threads)}
                    table = run_group(world, job)
                    per_step = np.max(np.asarray([r[: ctx.repeats] for r in table]), axis=0)
                    m = Measurement.of(per_step.tolist())
                    measured[layout] = m
                    case = (f"{preset}, {n:,} x {D}, {QUESTIONS} questions x k={K} per rank, "
                            f"W={world}")
                    row = Row.of(NAME, case, layout, m, {
                        "W": world, "preset": preset, "passages": n,
                        "threads/rank": job["threads"],
                        "oversubscribed": world > _cores(),
                        "index MB/rank": round(max(r[-1] for r in table), 1),
                        "RSS MB/rank": round(max(r[-2] for r in table), 1),
                        "recv KB/rank": round(step_bytes(world, QUESTIONS, K, D) / 1024, 1)
                        if layout == "sharded" else 0.0,
                    })
                    rows.append(row)
                    if base is None:
                        base = m
                for row, layout in zip(rows[-2:], ("full index per rank", "sharded")):
                    add_ratio(row, "vs W=1 full", base, measured[layout])
                    add_ratio(row, "vs full, same W", measured["full index per rank"], measured[layout])
        del xb
    return rows


# ------------------------------------------------------------------------------ tables
def render(results: dict, source: str) -> str:
    """A Markdown table of a results file's distributed rows, with a caption saying how and
    where it was measured (``source``: its name under ``benchmarks/results/``)."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    if not rows:
        raise ValueError(f"{source}: no rows of the {NAME!r} bench")
    m = results["machine"]
    args = results.get("args", {})
    command = run_command(args)
    lines = ["| preset, corpus | W | layout | ms per step (median) | spread | vs full index, same W "
             "| index MB/rank | RSS MB/rank | received KB/rank/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["extra"]
        ratio = e["vs full, same W"]
        flag = " (noisy)" if "vs full, same W" in r.get("noisy", []) else ""
        note = " (oversubscribed)" if e.get("oversubscribed") else ""
        lines.append(
            f"| {e['preset']}, {e['passages']:,} x {D} | {e['W']}{note} | {r['provider']} "
            f"| {r['median_ms']:.2f} | {r['spread']:.0%} | {ratio:.2f}x{flag} "
            f"| {e['index MB/rank']:,.1f} | {e['RSS MB/rank']:,.0f} "
            f"| {e['recv KB/rank'] if e['recv KB/rank'] else '-'} |")
    runs = sorted({len(r["runs_ms"]) for r in rows})
    caption = (
        f"Measured by `{command}` on {m['cpu']}, {m['cpu_count']} cores, torch "
        f"{m['torch'].split('+')[0]} (`{source_path(source)}`): retrieval time of one "
        f"training step, {QUESTIONS} questions x k={K} per rank (search and the winners' fp16 "
        f"vectors), median of {runs[0]} timed steps after {WARMUP} warm-up steps, each step "
        f"timed until the slowest rank is done, with {allocator_caption(rows)}; spread = (max - min) / median. `sharded`: each of "
        "the W gloo processes holds 1/W of the corpus (`ShardedIndex`); `full index per rank`: "
        "each holds all of it and searches its own questions. Each process runs max(1, "
        "cores / W) threads; with more processes than cores (oversubscribed) they share the "
        "cores, so those rows show the collectives' overhead on one machine, not the speedup of "
        "W machines. vs full index: > 1 means the sharded step is faster. Received KB: what "
        "one rank receives per sharded step (1/W of it from itself).")
    return caption + "\n\n" + "\n".join(lines)
