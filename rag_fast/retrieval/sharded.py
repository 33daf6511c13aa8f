"""ShardedIndex: one passage index spread over the ranks of a torch.distributed group.

Each rank holds one contiguous shard of the corpus, global passage ids ``[offset, offset +
count)``, as a :class:`~rag_fast.retrieval.index.DenseIndex` (any preset). A search is
collective: every rank calls :meth:`ShardedIndex.search` with its own questions (any number,
zero included), and gets back the top-k over the whole corpus with global ids.

One search, W ranks, rank r with ``n_r`` queries of dimension d, ``Q = sum(n_r)``:

1. ``all_gather`` of a small int64 header per rank (``n_r``, ``k``, an error flag, the
   search settings), so that every rank knows every batch size and a bad argument on
   one rank raises on all of them instead of leaving the others waiting in a collective;
2. ``all_gather`` of the queries, each padded to ``max(n_r)`` rows and trimmed after: every
   rank now holds all ``Q`` queries ``[Q, d]`` float32;
3. each rank searches its shard for all ``Q`` queries: ``[Q, k]`` scores and global ids (a
   shard with fewer than k vectors pads with ``-inf`` / ``-1``);
4. ``all_reduce`` (max) of a failure flag, so a shard that failed stops every rank;
5. ``all_to_all_single`` of scores and of ids routes the rows of rank r's queries back to
   rank r: it receives ``[W, n_r, k]``;
6. an exact merge of the ``W * k`` candidates of each query: the best k by score.

Only tensor collectives run per search (gloo on CPU tensors, nccl on CUDA tensors of the
rank's device); Python objects are exchanged once, when the index is constructed, to check
that the shards form one corpus.

Ties. The result is defined independently of how the corpus is cut: the k best by score,
listed by descending score and, among equal scores, by descending global id, which is the
order faiss lists equal scores in (a tie at the k-th place goes to the larger id). Which of
the passages tied at the k-th place faiss itself keeps depends on its search path (neither
the smallest nor the largest ids), so a shard of the exact preset searches ``k + 1`` results
to see whether the k-th score is tied with the next one, and widens that query's search
(doubling k) until the tie ends inside the results; then the list is put in the order
above. For the exact preset the sharded search thus equals :func:`search_exact_ties` on one
index over the whole corpus, and :meth:`DenseIndex.search` (ids and scores) wherever no tie
straddles the k-th place; the scores always. Approximate shards (hnsw, ivfpq, factory
strings) are merged exactly from each shard's own result, in the same order.

Generator inputs and exact passage vectors of the winners (:meth:`ShardedIndex.vectors`,
:meth:`ShardedIndex.generator_inputs`, both in :meth:`ShardedIndex.retrieve`, which returns
what :meth:`Retriever.retrieve` returns) come from the rank that holds each passage: the
requests (global ids) and the answers (fp16 vectors, int32 token ids) are routed with
``all_to_all_single``; the passages are read from that rank's memory-mapped store.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from rag_fast.retrieval.encoders import parse_shard, shard_rows
from rag_fast.retrieval.index import DenseIndex
from rag_fast.retrieval.inputs import check_int
from rag_fast.retrieval.passages import PassageStore, tokenizer_key
from rag_fast.retrieval.retriever import RetrievedPassages, special_tokens

_SETTINGS = ("nprobe", "ef_search", "rerank")


def _canonical(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` of each row in the order: score descending, then global id descending
    (the order faiss lists equal scores in), missing results (id -1, score ``-inf``) last;
    padded with ``-inf`` / ``-1`` to ``k`` columns."""
    by_id, pos = ids.sort(dim=1, descending=True, stable=True)
    s, pos2 = scores.gather(1, pos).sort(dim=1, descending=True, stable=True)
    s, i = s[:, :k], by_id.gather(1, pos2)[:, :k]
    if s.shape[1] < k:
        pad = k - s.shape[1]
        s = torch.cat([s, s.new_full((s.shape[0], pad), -math.inf)], 1)
        i = torch.cat([i, i.new_full((i.shape[0], pad), -1)], 1)
    return s, i


def search_exact_ties(index: DenseIndex, queries: torch.Tensor, k: int, offset: int = 0,
                      **settings) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`DenseIndex.search` with a defined order among equal scores: the ``k`` best by
    score, a tie going to the larger id (``offset`` + row), listed by (score descending, id
    descending); ``-inf`` / ``-1`` pad ``k`` beyond the index size.

    faiss lists equal scores by descending id too, but which of the passages tied at the
    k-th place it keeps depends on its search path; this function decides them by the rule,
    so its result is the same however the corpus is cut into shards, and equals
    ``index.search`` except where a tie straddles the k-th place.

    For an exact (``Flat``) index the ties at the k-th place are resolved by searching more
    (``k + 1``, then doubling for the queries still tied), so the result is exact under that
    order. For approximate indexes the index's own top ``min(k, N)`` is re-ordered only.

    Args:
        queries: ``[B, d]`` float tensor (results on its device).
    Returns:
        scores ``[B, k]`` float32, ids ``[B, k]`` int64 (``offset`` added to found rows).
    """
    n = len(index)
    exact = index.factory == "Flat"
    want = min(n, k + 1) if exact else min(n, k)
    scores, ids = index.search(queries, want, **settings)
    if exact and want > k:
        # rows whose k-th score equals the (k+1)-th: the tie may reach further down the list
        tied = (scores[:, k - 1] == scores[:, k]).nonzero().flatten()
        width = want
        while len(tied) and width < n:
            width = min(n, 2 * width)
            s2, i2 = index.search(queries[tied], width, **settings)
            grow = width - scores.shape[1]  # widen every row's lists (-inf / -1 beyond)
            scores = torch.cat([scores, scores.new_full((len(scores), grow), -math.inf)], 1)
            ids = torch.cat([ids, ids.new_full((len(ids), grow), -1)], 1)
            scores[tied], ids[tied] = s2, i2
            tied = tied[s2[:, -1] == s2[:, k - 1]]
    ids = torch.where(ids >= 0, ids + offset, ids)
    return _canonical(scores, ids, k)


def _shard_index(root: Path, path: Path, emb: np.ndarray, shard: tuple[int, int], key, preset: str,
                 cache: bool, verify: bool, progress: bool, build_kwargs: dict) -> DenseIndex:
    """Build the index of one staged shard, or (``cache``) reuse the one saved next to it by
    an earlier call with the same embeddings file, staging key, preset and build settings."""
    if not cache:
        return DenseIndex.build(emb, preset, progress=progress, **build_kwargs)
    import hashlib

    st = path.stat()
    settings = {k: v for k, v in build_kwargs.items() if k != "meta"}
    stamp = json.loads(json.dumps({"embeddings": path.name, "bytes": st.st_size,
                                   "mtime_ns": st.st_mtime_ns, "staging_key": key,
                                   "preset": preset, "build": settings}, sort_keys=True, default=str))
    tag = hashlib.sha256(json.dumps([stamp["preset"], stamp["build"]], sort_keys=True)
                         .encode()).hexdigest()[:12]
    where = root / f"index-{shard[0]}-of-{shard[1]}-{tag}"
    if where.is_dir():
        try:
            saved = DenseIndex.load(where, verify=verify)
            if saved.meta.get("shard_cache") == stamp and len(saved) == len(emb):
                return saved
        except (OSError, ValueError):  # damaged or from another faiss: built again below
            pass
    meta = {**(build_kwargs.get("meta") or {}), "shard_cache": stamp}
    index = DenseIndex.build(emb, preset, progress=progress, meta=meta, **settings)
    index.save(where, overwrite=True)
    return index


def comm_device(group, device) -> torch.device:
    """Where ``group``'s collectives exchange tensors: ``device`` when given, else the current
    CUDA device for an NCCL group and the CPU for any other backend."""
    if device is not None:
        return torch.device(device)
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ShardedIndex:
    """One rank's shard of a passage index spread over a process group.

    Args:
        index: this rank's shard, global passage ids ``[offset, offset + len(index))``.
        offset: the global id of the shard's first row.
        group: the torch.distributed process group (default: the world; must be
            initialised). One shard per rank: the shards of all ranks must tile
            ``[0, N)`` without gap or overlap.
        store: passages for :meth:`generator_inputs` (optional): the whole corpus (``N``
            rows, global ids are rows) or this shard only (``len(index)`` rows).
        device: where collectives run; default: the current CUDA device for an nccl group,
            else the CPU.
        shard: ``(i, n)`` when the shard was made as shard i of n (``rag-fast index build
            --shard i/n``): checked to be a complete set of ``n`` = world size shards.
        meta: what must agree between the shards (e.g. the encoder that made them): compared
            across ranks.

    Construction is collective (every rank of ``group`` calls it): the shards' ranges,
    dimensions, presets, shard numbers and ``meta`` are exchanged once and checked.

    Raises:
        ValueError: on every rank, naming the argument: a missing or duplicated shard (or
            rows), another dimension, preset or encoder on another rank, a world size other
            than the number of shards, a store of the wrong size.
    """

    def __init__(self, index: DenseIndex, offset: int, *, group=None, store: PassageStore | None = None,
                 device: str | torch.device | None = None, shard: tuple[int, int] | None = None,
                 meta: dict | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised (call "
                             "torch.distributed.init_process_group first)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = comm_device(self.group, device)
        error = None
        try:
            if not isinstance(index, DenseIndex):
                raise ValueError(f"index must be a DenseIndex, got {type(index).__name__}")
            offset = check_int("offset", offset, 0, 2**62)
            if shard is not None:

                shard = parse_shard(shard)
            if store is not None and not isinstance(store, PassageStore):
                raise ValueError(f"store must be a PassageStore or None, got {type(store).__name__}")
            info = {"offset": offset, "count": len(index), "dim": index.dim, "preset": index.preset,
                    "factory": index.factory, "shard": list(shard) if shard is not None else None,
                    "meta": meta or {}, "store": len(store) if store is not None else None}
        except Exception as exc:  # said to every rank below, then raised
            error, info = exc, None
        infos: list = [None] * self.world_size
        dist.all_gather_object(infos, {"error": None if error is None else str(error), "info": info},
                               group=self.group)
        if error is not None:
            raise error
        failed = [r for r, x in enumerate(infos) if x["error"] is not None]
        if failed:
            raise ValueError(f"the shard of rank(s) {failed} could not be opened: "
                             + "; ".join(f"rank {r}: {infos[r]['error']}" for r in failed))
        infos = [x["info"] for x in infos]
        self._check_set(infos)
        self.index, self.offset, self.store, self.meta = index, offset, store, dict(meta or {})
        self.shard = tuple(shard) if shard is not None else None
        self.shards = [(x["offset"], x["count"]) for x in infos]  # per rank
        self.total = sum(c for _, c in self.shards)
        self.dim = index.dim
        starts = sorted((o, r) for r, (o, _) in enumerate(self.shards))
        self._starts = torch.tensor([o for o, _ in starts], dtype=torch.int64)
        self._owner_of_start = torch.tensor([r for _, r in starts], dtype=torch.int64)
        self._store_offset = 0 if store is not None and len(store) == self.total else offset

    def _check_set(self, infos: list[dict]) -> None:
        """The shards of all ranks form one corpus (same checks and message on every rank)."""
        w = self.world_size
        dims = [x["dim"] for x in infos]
        if len(set(dims)) != 1:
            raise ValueError(f"index: the shards have different dimensions (per rank {dims}); "
                             "they must come from one encoder")
        presets = [x["preset"] for x in infos]
        if len(set(presets)) != 1:
            raise ValueError(f"index: the shards have different presets (per rank {presets}); "
                             "build every shard with the same preset")
        metas = [json.dumps(x["meta"], sort_keys=True, default=str) for x in infos]
        if len(set(metas)) != 1:
            differ = sorted({key for x in infos for key in x["meta"]
                             if any(y["meta"].get(key) != x["meta"].get(key) for y in infos)})
            raise ValueError(f"meta: the shards were made with different settings ({', '.join(differ)} "
                             "differ between ranks), e.g. another encoder")
        shards = [x["shard"] for x in infos]
        if any(s is not None for s in shards):
            if any(s is None for s in shards):
                raise ValueError("shard: some ranks name their shard (i, n) and others do not")
            counts = sorted({n for _, n in shards})
            if counts != [w]:
                raise ValueError(f"shard: the world size is {w} but the shards are of "
                                 f"{' and '.join(map(str, counts))} (one shard per rank: run "
                                 f"{counts[0]} processes, or make {w} shards)")
            seen: dict[int, list[int]] = {}
            for r, (i, _) in enumerate(shards):
                seen.setdefault(i, []).append(r)
            dup = {i: rs for i, rs in seen.items() if len(rs) > 1}
            if dup:
                raise ValueError("shard: duplicated shard(s): " + ", ".join(
                    f"shard {i}/{w} on ranks {rs}" for i, rs in sorted(dup.items()))
                    + f"; missing {sorted(set(range(w)) - set(seen))}")
        spans = sorted((x["offset"], x["offset"] + x["count"], r) for r, x in enumerate(infos))
        per_rank = [(x["offset"], x["count"]) for x in infos]
        end = 0
        for lo, hi, r in spans:
            if lo > end:
                raise ValueError(f"offset: no shard holds passages [{end}, {lo}) (a missing shard; "
                                 f"shards per rank (offset, count): {per_rank})")
            if lo < end:
                raise ValueError(f"offset: passages [{lo}, {min(end, hi)}) are in more than one shard "
                                 f"(rank {r} and another; a duplicated shard; shards per rank (offset, "
                                 f"count): {per_rank})")
            end = hi
        for r, x in enumerate(infos):
            if x["store"] is not None and x["store"] not in (end, x["count"]):
                raise ValueError(f"store: rank {r}'s store has {x['store']} passages; expected the "
                                 f"whole corpus ({end}) or its shard ({x['count']})")

    # ---- construction from `rag-fast index build --shard i/n` ---------------------------------
    @classmethod
    def from_shards(cls, directory: str | Path, preset: str = "exact", *, group=None,
                    shard: str | tuple[int, int] | None = None, device=None, verify: bool = True,
                    progress: bool = False, cache: bool = False, **build_kwargs) -> "ShardedIndex":
        """Open this rank's shard of a staging directory that ``rag-fast index build --out DIR
        --shard i/n`` processes wrote (``DIR.staging/``: ``key.json``, ``passages/`` and
        ``embeddings-i-of-n.npy``) and build its index with ``preset`` (any preset or faiss
        factory string; ``build_kwargs`` go to :meth:`DenseIndex.build`).

        Rank r opens shard r of n = world size unless ``shard`` says otherwise. The staged
        ``key.json`` (passages, encoder and its settings) must be the same on every rank.
        Collective.

        With ``cache=True`` the built shard index is saved (atomically) in
        ``directory/index-i-of-n-TAG/`` (TAG: a hash of ``preset`` and ``build_kwargs``) and
        later calls open it instead of building again (its fp16 vectors memory-mapped) while
        the shard's embeddings file (name, size, modification time), the staging key, the
        preset and the build settings are unchanged; otherwise it is rebuilt and replaced.

        Raises:
            ValueError: on every rank: a missing shard file, wrong row counts, a world size
                other than the number of shards, a duplicated or missing shard, keys that differ.
            StorageError: (a ValueError) the staged passages are corrupt.
        """

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised")
        g = group if group is not None else dist.group.WORLD
        index = store = key = None
        offset = 0
        error = None
        try:
            i, n = parse_shard(shard) if shard is not None else (dist.get_rank(g), dist.get_world_size(g))
            root = Path(directory)
            if not root.is_dir():
                raise ValueError(f"directory: {str(root)!r} is not a directory")
            path = root / f"embeddings-{i}-of-{n}.npy"
            if not path.is_file():
                staged = sorted(p.name for p in root.glob("embeddings-*-of-*.npy"))
                raise ValueError(f"directory: shard {i}/{n} is missing: no {path.name} in {str(root)!r} "
                                 f"(staged: {staged or 'none'})")
            try:
                key = json.loads((root / "key.json").read_text())
            except (OSError, ValueError, RecursionError):
                raise ValueError(f"directory: {str(root)!r} has no readable key.json (not a staging "
                                 "directory of `rag-fast index build --shard`)") from None
            store = PassageStore.load(root / "passages", verify=verify)
            try:  # object arrays cannot be mapped, a bad header cannot be read
                emb = np.load(path, mmap_mode="r")
            except (ValueError, OSError, EOFError) as e:
                raise ValueError(f"directory: {path} is not a shard of embeddings ({e})") from None
            lo, hi = shard_rows(len(store), (i, n))
            if emb.ndim != 2 or emb.shape[0] != hi - lo:
                raise ValueError(f"directory: {path.name} has shape {emb.shape}, shard {i}/{n} of "
                                 f"{len(store)} passages has {hi - lo} rows")
            index = _shard_index(root, path, emb, (i, n), key, preset, cache, verify, progress,
                                 build_kwargs)
            offset = lo
            shard_spec = (i, n)
        except Exception as exc:  # said to every rank below, then raised here
            error = exc
        if error is not None:
            # the others must not wait for this rank in the collective checks: say it to all
            infos: list = [None] * dist.get_world_size(g)
            dist.all_gather_object(infos, {"error": str(error), "info": None}, group=g)
            if isinstance(error, (ValueError, OSError)):
                raise ValueError(f"rank {dist.get_rank(g)}: {error}") from error
            raise error
        return cls(index, offset, group=group, store=store, device=device, shard=shard_spec,
                   meta={"staging_key": key})

    # ---- search -------------------------------------------------------------------------------
    def _agree(self, values: Sequence[int]) -> torch.Tensor:
        """all_gather of a few int64 per rank: ``[W, len(values)]`` on the CPU."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return torch.stack(out).cpu()

    def _fail_together(self, failed: bool) -> bool:
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def search(self, queries: torch.Tensor | np.ndarray, k: int, *, nprobe: int | None = None,
               ef_search: int | None = None, rerank: int | None = None):
        """Top-``k`` inner products over the whole corpus for this rank's queries. Collective:
        every rank of the group calls it, with the same ``k`` and settings.

        Args:
            queries: ``[n_r, d]`` float tensor (any device) or numpy array; ``n_r`` may differ
                between ranks and may be 0.
            k: ``1 <= k <= N`` (the whole corpus); may exceed a shard.
            nprobe, ef_search, rerank: the shards' search settings (see DenseIndex.search).
        Returns:
            scores ``[n_r, k]`` float32 (descending; ties: larger id first) and ids ``[n_r, k]``
            int64 global passage ids, on the queries' device (numpy for numpy queries); a slot
            with no result has id -1 and score ``-inf``.
        Raises:
            ValueError: on every rank, naming ``queries``, ``k`` or a setting, when any rank
                passed a bad one (the message says which rank).
        """
        is_numpy = isinstance(queries, np.ndarray)
        out_device = queries.device if isinstance(queries, torch.Tensor) else torch.device("cpu")
        error = None
        settings = {"nprobe": nprobe, "ef_search": ef_search, "rerank": rerank}
        try:
            q = self._check_queries(queries)
            k = check_int("k", k, 1, max(1, self.total))
            for name, value in settings.items():
                if value is not None:
                    check_int(name, value)
        except ValueError as exc:
            error, q = exc, None
        n_r = q.shape[0] if q is not None else 0
        header = self._agree([n_r, k if error is None else -1, int(error is not None)]
                             + [settings[s] or 0 for s in _SETTINGS])
        if error is not None:
            raise error
        bad = header[:, 2].nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"queries/k: rank(s) {bad} passed invalid arguments to search (see "
                             "the error on those ranks)")
        if len(set(header[:, 1].tolist())) != 1:
            raise ValueError(f"k must be the same on every rank, got {header[:, 1].tolist()} (per rank)")
        for j, name in enumerate(_SETTINGS):
            if len(set(header[:, 3 + j].tolist())) != 1:
                raise ValueError(f"{name} must be the same on every rank, got "
                                 f"{[v or None for v in header[:, 3 + j].tolist()]} (per rank)")
        sizes = header[:, 0].tolist()
        total_q = sum(sizes)
        if total_q == 0:
            s, i = torch.empty((0, k)), torch.empty((0, k), dtype=torch.int64)
            return (s.numpy(), i.numpy()) if is_numpy else (s.to(out_device), i.to(out_device))
        # all queries of all ranks, padded to the largest batch for all_gather
        width = max(sizes)
        padded = torch.zeros((width, self.dim), dtype=torch.float32, device=self.device)
        padded[:n_r] = q.to(self.device)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        all_q = torch.cat([g[:m] for g, m in zip(gathered, sizes)])
        failed = None
        try:
            search_q = all_q if (all_q.is_cuda and self.index._gpu is not None) else all_q.cpu()
            s, i = search_exact_ties(self.index, search_q, k, self.offset,
                                     **{key: v for key, v in settings.items() if v is not None})
            s, i = s.to(self.device).contiguous(), i.to(self.device).contiguous()
        except Exception as exc:  # said to every rank, then raised here
            failed = exc
        if self._fail_together(failed is not None):
            if failed is not None:
                raise failed
            raise RuntimeError("search failed on another rank's shard (see the error there)")
        # route rank r's rows back to rank r: it receives [W, n_r, k]
        recv_s = torch.empty((self.world_size * n_r, k), dtype=torch.float32, device=self.device)
        recv_i = torch.empty((self.world_size * n_r, k), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(recv_s, s, [n_r] * self.world_size, sizes, group=self.group)
        dist.all_to_all_single(recv_i, i, [n_r] * self.world_size, sizes, group=self.group)
        cand_s = recv_s.view(self.world_size, n_r, k).permute(1, 0, 2).reshape(n_r, self.world_size * k)
        cand_i = recv_i.view(self.world_size, n_r, k).permute(1, 0, 2).reshape(n_r, self.world_size * k)
        scores, ids = _canonical(cand_s, cand_i, k)
        if is_numpy:
            return scores.cpu().numpy(), ids.cpu().numpy()
        return scores.to(out_device), ids.to(out_device)

    def _check_queries(self, queries) -> torch.Tensor:
        if isinstance(queries, np.ndarray):
            if not np.issubdtype(queries.dtype, np.floating):
                raise ValueError(f"queries must be a floating array, got dtype {queries.dtype}")
            queries = torch.from_numpy(np.ascontiguousarray(queries))
        elif not isinstance(queries, torch.Tensor) or not queries.is_floating_point():
            raise ValueError("queries must be a floating tensor or array [n, d], got "
                             f"{getattr(queries, 'dtype', type(queries).__name__)}")
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must have shape [n, d={self.dim}], got {tuple(queries.shape)}")
        q = queries.detach().float()
        if not bool(torch.isfinite(q).all()):
            raise ValueError("queries contain NaN or inf")
        return q

    # ---- rows of the winners ----------------------------------------------------------------
    def _owners(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank holding each global id (``ids`` >= 0, CPU int64)."""
        pos = torch.searchsorted(self._starts, ids, right=True) - 1
        return self._owner_of_start[pos]

    def _fetch(self, ids: torch.Tensor, answer, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
        """Rows for global ``ids`` ``[m]`` (-1 -> zeros) from the ranks holding them.

        ``answer(global ids as numpy)`` runs on the owner and returns ``[len, width]`` rows, or
        with ``width=None`` a list of 1-D rows of any length: then the longest row asked of any
        rank fixes the width (one all_reduce), and column 0 of the result holds each row's
        length. Requests and answers are routed with all_to_all_single (counts first).
        Collective."""
        ids = ids.to("cpu", torch.int64)
        valid = (ids >= 0).nonzero().flatten()
        want = ids[valid]
        owner = self._owners(want)
        order = owner.argsort(stable=True)
        send_counts = torch.bincount(owner, minlength=self.world_size)
        recv_counts = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        dist.all_to_all_single(recv_counts, send_counts.to(self.device), group=self.group)
        send_l, recv_l = send_counts.tolist(), recv_counts.cpu().tolist()
        asked = torch.empty(sum(recv_l), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(asked, want[order].contiguous().to(self.device), recv_l, send_l,
                               group=self.group)
        answered = answer(asked.cpu().numpy())
        if width is None:  # ragged rows: [length, values..., 0 padding]
            longest = torch.tensor([max((len(r) for r in answered), default=0)], dtype=torch.int64,
                                   device=self.device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.group)
            width = int(longest.item()) + 1
            rows = torch.zeros((len(answered), width), dtype=dtype)
            for j, r in enumerate(answered):
                rows[j, 0] = len(r)
                rows[j, 1 : 1 + len(r)] = torch.from_numpy(np.asarray(r)).to(dtype)
        else:
            rows = torch.from_numpy(np.ascontiguousarray(answered)).to(dtype).reshape(len(asked), width)
        rows = rows.to(self.device)
        back = torch.empty((sum(send_l), width), dtype=dtype, device=self.device)
        dist.all_to_all_single(back, rows, send_l, recv_l, group=self.group)
        out = torch.zeros((len(ids), width), dtype=dtype, device=self.device)
        out[valid[order].to(self.device)] = back
        return out

    def _check_ids(self, ids) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
            raise ValueError(f"ids must be an int64 tensor of global passage ids, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= self.total):
            raise ValueError(f"ids must be in [-1, {self.total}) (-1: no passage), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return ids

    def _checked(self, ids):
        error = None
        try:
            ids = self._check_ids(ids)
        except ValueError as exc:
            error = exc
        if self._fail_together(error is not None):
            raise error or ValueError("ids: another rank passed invalid ids (see the error there)")
        return ids

    def vectors(self, ids: torch.Tensor) -> torch.Tensor:
        """The exact (fp16-stored) passage vectors of global ``ids`` ``[...]``, as
        ``[..., d]`` float32 on ``ids``' device (zeros for -1), read on the ranks that hold
        them. Collective."""
        ids = self._checked(ids)
        emb = self.index.embeddings

        def answer(rows: np.ndarray) -> np.ndarray:
            return emb[rows - self.offset]

        flat = self._fetch(ids.reshape(-1), answer, torch.float16, self.dim)
        return flat.float().reshape(*ids.shape, self.dim).to(ids.device)

    def _tokenizer_parts(self, tokenizer) -> dict:
        """What generator inputs need of ``tokenizer``, computed once per tokenizer object:
        its store key (a hash of its vocabulary) and its special tokens."""

        cache = self.__dict__.setdefault("_tokenizer_cache", {})
        entry = cache.get(id(tokenizer))
        if entry is not None and entry[0] is tokenizer:
            return entry[1]
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("tokenizer must have a pad token (set tokenizer.pad_token)")
        prefix, suffix = special_tokens(tokenizer)
        parts = {"key": tokenizer_key(tokenizer), "prefix": prefix, "suffix": suffix}
        cache[id(tokenizer)] = (tokenizer, parts)
        return parts

    @staticmethod
    def _separator(tokenizer, text: str) -> np.ndarray:
        # stored texts and questions are tokenised with a leading space: a separator's trailing
        # space belongs to the next piece (as in the joined string)
        return np.asarray(tokenizer(text.rstrip(), add_special_tokens=False)["input_ids"], np.int64)

    def passage_tokens(self, ids: torch.Tensor, tokenizer, title_sep: str = " / ",
                       max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids of ``title + title_sep + text`` (no special tokens) for global ``ids``
        ``[m]``, from the pre-tokenised store of the rank holding each passage (tokenised on
        first use, see :meth:`PassageStore.tokenized`). Collective.

        Returns:
            tokens ``[m, L]`` int64 (0-padded) and lengths ``[m]`` int64 (0 for id -1), on
            ``ids``' device; each row cut to ``max_tokens`` when given.
        Raises:
            ValueError: on every rank: a rank without a store (pass ``store=``), bad ids or
                tokenizer on any rank.
        """
        ids = self._checked(ids.reshape(-1))
        error = None
        try:
            if self.store is None:
                raise ValueError("store: this rank's ShardedIndex has no passage store (pass store=)")
            parts = self._tokenizer_parts(tokenizer)
            tok = self.store.tokenized(tokenizer, progress=False, key=parts["key"])
        except (ValueError, OSError) as exc:
            error = exc
        if self._fail_together(error is not None):
            raise error or ValueError("store/tokenizer: another rank cannot serve passage tokens "
                                      "(see the error there)")
        sep = self._separator(tokenizer, title_sep).astype(np.int32)

        def answer(rows: np.ndarray) -> list[np.ndarray]:
            local = rows - self._store_offset
            return [np.concatenate([tok.titles[r], sep, tok.texts[r]])[:max_tokens] for r in local.tolist()]

        rows = self._fetch(ids, answer, torch.int32).to(torch.int64)
        return rows[:, 1:].to(ids.device), rows[:, 0].to(ids.device)

    def generator_inputs(self, ids: torch.Tensor, questions: Sequence[str], tokenizer, *,
                         max_length: int = 300, title_sep: str = " / ",
                         doc_sep: str = " // ") -> tuple[torch.Tensor, torch.Tensor]:
        """The generator's ``input_ids`` and ``attention_mask`` ``[n*K, L]`` for global ``ids``
        ``[n, K]`` and this rank's ``n`` questions: row ``b*K + j`` is ``title + title_sep +
        text + doc_sep + question`` of passage j of question b, cut to ``max_length`` with the
        special tokens kept, padded to the longest row: the rows
        :class:`~rag_fast.retrieval.retriever.Retriever` builds from one store. Collective.

        Raises:
            ValueError: on every rank, naming ``ids``, ``questions``, ``tokenizer`` or
                ``max_length`` when a rank passed a bad one.
        """
        error = None
        try:
            if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
                raise ValueError(f"ids must be a tensor of shape [n, K], got {tuple(getattr(ids, 'shape', ()))}")
            if isinstance(questions, str) or len(questions) != ids.shape[0]:
                raise ValueError(f"questions must be a list of {ids.shape[0]} strings (one per row of ids)")
            parts = self._tokenizer_parts(tokenizer)
            prefix, suffix = parts["prefix"], parts["suffix"]
            budget = (max_length - len(prefix) - len(suffix)
                      if isinstance(max_length, int) and not isinstance(max_length, bool) else 0)
            if budget < 1:
                raise ValueError(f"max_length must be an int > the {len(prefix) + len(suffix)} special "
                                 f"tokens, got {max_length!r}")
        except ValueError as exc:
            error = exc
        if self._fail_together(error is not None):
            raise error or ValueError("ids/questions/tokenizer: another rank passed invalid generator "
                                      "inputs (see the error there)")
        tokens, lengths = self.passage_tokens(ids.reshape(-1), tokenizer, title_sep, budget)
        tokens, lengths = tokens.cpu().numpy(), lengths.cpu().tolist()
        doc = self._separator(tokenizer, doc_sep)
        encoded = tokenizer([" " + q for q in questions], add_special_tokens=False)["input_ids"] \
            if len(questions) else []
        k = ids.shape[1]
        rows = []
        for b, question in enumerate(encoded):
            question = np.asarray(question, np.int64)
            for j in range(k):
                m = b * k + j
                content = np.concatenate([tokens[m, : lengths[m]], doc, question])[:budget]
                rows.append(np.concatenate([prefix, content, suffix]))
        length = max((len(r) for r in rows), default=0)
        input_ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), length), dtype=torch.int64)
        left = getattr(tokenizer, "padding_side", "right") == "left"
        for i, r in enumerate(rows):
            span = slice(length - len(r), length) if left else slice(0, len(r))
            input_ids[i, span] = torch.from_numpy(r)
            mask[i, span] = 1
        return input_ids.to(ids.device), mask.to(ids.device)

    def retrieve(self, question_embeddings: torch.Tensor, questions: Sequence[str] | None = None,
                 tokenizer=None, *, n_docs: int = 5, max_length: int = 300, title_sep: str = " / ",
                 doc_sep: str = " // ", **search_kwargs):
        """What :meth:`Retriever.retrieve <rag_fast.retrieval.retriever.Retriever.retrieve>`
        returns, over the sharded corpus: ids and scores ``[B, K]`` (global ids), the exact
        passage vectors ``[B, K, d]`` float32 and, when ``tokenizer`` is given, the generator
        inputs ``[B*K, L]`` for ``questions``, all on the embeddings' device. Collective: every
        rank calls it (B may be 0), all with or all without a tokenizer.

        Returns:
            :class:`~rag_fast.retrieval.retriever.RetrievedPassages` (version 0).
        """

        scores, ids = self.search(question_embeddings, n_docs, **search_kwargs)
        device = question_embeddings.device
        doc_embeddings = self.vectors(ids).to(device)
        want = self._agree([int(tokenizer is not None)])[:, 0].tolist()
        if len(set(want)) != 1:
            raise ValueError(f"tokenizer: given on some ranks and not on others (per rank {want}); "
                             "generator inputs are built by all ranks or none")
        input_ids = attention_mask = None
        if tokenizer is not None:
            input_ids, attention_mask = self.generator_inputs(
                ids, questions if questions is not None else [], tokenizer, max_length=max_length,
                title_sep=title_sep, doc_sep=doc_sep)
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        return RetrievedPassages(ids, scores, doc_embeddings, input_ids, attention_mask, 0)

    def __len__(self) -> int:
        return self.total

    def __repr__(self) -> str:
        return (f"ShardedIndex(rank {self.rank}/{self.world_size}: passages [{self.offset}, "
                f"{self.offset + len(self.index)}) of {self.total}, preset {self.index.preset!r})")


class ShardedRetriever:
    """A :class:`ShardedIndex` as the retriever of a :class:`~rag_fast.models.RagModel`
    (``model.retriever``): every rank's forward pass retrieves for its own questions through
    the collective search.

    ``retrieve(question_embeddings, questions=None, n_docs=None, **search_kwargs)`` returns
    :class:`~rag_fast.retrieval.retriever.RetrievedPassages` with global ids, scores and the
    exact passage vectors (no generator inputs: RagModel writes the contexts from the
    passages' texts with its own tokenizer, reading them from :attr:`store`, which must hold
    the whole corpus, as the staging directory's ``passages/`` does; it is memory-mapped).

    Collective: every rank of the index's group must call :meth:`retrieve` the same number of
    times, in the same order relative to the group's other collectives (DDP's gradient
    all-reduce included). The :class:`~rag_fast.training.Trainer` arranges that: each rank
    runs the same number of micro-batches per step, and evaluation runs on every rank when
    the model's retriever is ``collective``.

    Attributes:
        collective: True (the Trainer evaluates on every rank).
        retrieval_seconds: wall time spent in :meth:`retrieve` so far (this rank), the
            collectives' waiting included; the Trainer reports it per step.
        version: 0, then 1 more after each :meth:`swap` (an index refresh during
            training, see ``rag_fast.training.refresh``).

    Raises:
        ValueError: the index has no store, or its store is only this rank's shard.
    """

    collective = True

    def __init__(self, index: ShardedIndex, *, n_docs: int = 5):
        if not isinstance(index, ShardedIndex):
            raise ValueError(f"index must be a ShardedIndex, got {type(index).__name__}")
        if not isinstance(n_docs, int) or isinstance(n_docs, bool) or n_docs < 1:
            raise ValueError(f"n_docs must be a positive int, got {n_docs!r}")
        if index.store is None or len(index.store) != index.total:
            have = "none" if index.store is None else f"{len(index.store)} passages"
            raise ValueError(f"store: a ShardedRetriever needs the whole corpus's passage store "
                             f"({index.total} passages) on every rank, got {have}")
        self.sharded, self.n_docs = index, n_docs
        self.retrieval_seconds = 0.0
        self.calls = 0
        self.version = 0

    def swap(self, index: ShardedIndex) -> int:
        """Replace the sharded index (one reference assignment); returns the new version.

        Collective in effect: every rank must swap before its next :meth:`retrieve`, so that
        no rank searches the old shards while another searches the new ones (the Trainer
        swaps on every rank at the same step, after all ranks built their shard).

        Raises:
            ValueError: not a ShardedIndex, or another corpus size, dimension or store.
        """
        old = self.sharded
        if not isinstance(index, ShardedIndex):
            raise ValueError(f"index must be a ShardedIndex, got {type(index).__name__}")
        if index.total != old.total or index.dim != old.dim:
            raise ValueError(f"index covers {index.total} passages of dimension {index.dim}; the "
                             f"current one {old.total} of dimension {old.dim}")
        if index.store is None or len(index.store) != index.total:
            raise ValueError("store: the new ShardedIndex needs the whole corpus's passage store")
        self.sharded, self.version = index, self.version + 1
        return self.version

    @property
    def store(self) -> PassageStore:
        return self.sharded.store

    @property
    def index(self) -> DenseIndex:
        """This rank's shard."""
        return self.sharded.index

    def retrieve(self, question_embeddings: torch.Tensor, questions: Sequence[str] | None = None,
                 n_docs: int | None = None, **search_kwargs):
        """K passages for this rank's B questions (B may be 0). Collective.

        Returns:
            :class:`~rag_fast.retrieval.retriever.RetrievedPassages` (``input_ids`` and
            ``attention_mask`` None).
        """
        import time

        start = time.perf_counter()
        try:
            k = self.n_docs if n_docs is None else n_docs
            sharded, version = self.sharded, self.version  # one snapshot for the whole call
            found = sharded.retrieve(question_embeddings, n_docs=k, **search_kwargs)
            found.version = version
            return found
        finally:
            self.retrieval_seconds += time.perf_counter() - start
            self.calls += 1

    __call__ = retrieve

    def __len__(self) -> int:
        return self.sharded.total

    def __repr__(self) -> str:
        return f"ShardedRetriever(n_docs={self.n_docs}, {self.sharded!r})"
