"""DenseIndex: maximum inner product search over passage embeddings with FAISS.

Presets:
    exact   flat inner product (BLAS); the reference every other preset is measured against.
    hnsw    graph search (HNSW32 over the float vectors); ``ef_search`` per call.
    ivfpq   (default) an inverted file over a 4-bit fast-scan product quantiser, whose
            candidates are re-ranked exactly from the stored fp16 vectors. The compressed
            codes make the scan cheap (about d/16 bytes per vector) and re-ranking makes the
            top-k exact among the ``rerank * max(k, 10)`` candidates; ``nprobe`` and ``rerank`` per call.
    any other string is a faiss factory string (inner product metric), read and sized by
            rag_fast before faiss allocates any of it (see :func:`factory_sizes`).

On-disk inverted lists (``build(..., on_disk=True)``, ``rag-fast index build --on-disk``): the
index is built as an IVF whose lists faiss can memory-map (with ``ivfpq``:
``IVF{nlist},PQ{M}``, 8-bit codes rather than fast-scan, whose blocked lists faiss always
reads into RAM; a factory string must be such an IVF, e.g. ``IVF4096,SQ8``), the manifest
says so, and :meth:`DenseIndex.load` opens ``index.faiss`` with faiss's ``IO_FLAG_MMAP``: the
coarse quantiser and the codebooks are read into RAM, the codes and ids of the lists stay in
the file and are paged in by the lists a search visits.

Every index keeps the vectors themselves as fp16 in a faiss scalar-quantiser store
(``vectors.faiss``): its codes are the IEEE fp16 bytes, so the same memory is both faiss's
re-ranking store and :attr:`DenseIndex.embeddings` (a ``[N, d]`` float16 numpy view), and on
load it is memory-mapped, not read into RAM. The trade-off: the fp16 copy costs 2 bytes per
dimension beside the index (needed anyway for exact passage scores), and re-ranking reads
``rerank * max(k, 10)`` random rows per query.

On a GPU: faiss GPU when faiss has it (sharded over every GPU); exact torch search on the GPU
otherwise or for index types faiss cannot move (fast-scan PQ); the GPU's limits on k and
nprobe (2048) are respected. Saved as a directory (``manifest.json`` with dimension, metric,
count, preset, parameters, faiss version and SHA-256 checksums) written atomically.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_fast import _ext
from rag_fast.retrieval._exact import exact_search
from rag_fast.retrieval.factory import (PRESETS, SMALL_CORPUS, check_corpus, check_on_disk,
                                        check_recorded_factory,
                                        default_train_points, factory_sizes,
                                        new_index, on_disk_error, plan_factory, preset_factory)
from rag_fast.retrieval.faiss_support import (LazyFaiss, extract_ivf, faiss_gpu_count,
                                              faiss_gpu_supports, lists_mappable, search_tensor,
                                              write_all, write_faiss)
from rag_fast.retrieval.inputs import (MAX_SETTING, NonFiniteError, check_finite, check_int,
                                       check_queries, corpus_rows, corpus_shape, reads_a_copy)
from rag_fast.retrieval.tuning import (RERANK_FACTORS, SmallSampleWarning, measure_quality,
                                       min_tuning_queries, recall_at_k, small_sample_message,
                                       tune_settings)
from rag_fast.storage import (MANIFEST, StorageError, atomic_directory, describe_files, no_space,
                              read_manifest, reserve_space, write_manifest)

# The public names of this module: its own, and those of the modules split from it (factory
# strings, faiss, inputs, tuning) that its importers (bundle.py, the CLI, benchmarks, tests)
# still take from here.
__all__ = ["FLAT_CHUNK", "FORMAT", "GPU_MAX_K", "INDEX_KIND", "PRESETS", "RERANK_FACTORS",
           "RERANK_MIN_K", "SETTINGS", "SMALL_CORPUS", "DenseIndex", "SmallSampleWarning",
           "check_corpus", "factory_sizes", "faiss_gpu_count", "faiss_gpu_supports",
           "lists_mappable", "min_tuning_queries", "plan_factory", "preset_factory", "recall_at_k",
           "small_sample_message"]

faiss = LazyFaiss(__name__)

INDEX_KIND = "rag_fast.dense_index"
FORMAT = 1
FLAT_CHUNK = 1 << 16  # vectors per matmul of the exact preset's search (see _flat_vectors)
GPU_MAX_K = 2048  # faiss GPU's largest k and nprobe
RERANK_MIN_K = 10  # a re-ranking search fetches at least rerank * 10 candidates (the tuned k)
_INDEX_FILE, _VECTORS_FILE = "index.faiss", "vectors.faiss"
_WRITE_CHUNK = 1 << 23  # bytes per write of a saved index file
_PREFETCH_THREADS = 0  # faiss OnDiskInvertedLists.prefetch_nthread for mapped lists (see load)
_warned: set[str] = set()
_lock = threading.Lock()


def _warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


SETTINGS = ("nprobe", "ef_search", "rerank")  # the search settings of params / search() / tune()
_MANIFEST_KEYS = ("kind", "format", "preset", "factory", "count", "dim", "metric", "params",
                  "faiss_version", "meta", "files")
_OPTIONAL_KEYS = ("on_disk",)  # absent from manifests written before it existed (= False)


class _Owned:
    """A raw buffer for numpy that keeps its owner alive: ``np.asarray(_Owned(...))`` has this
    object as its ``base``, so every view of it holds the owner (e.g. a faiss index whose
    memory, or memory map, the buffer is)."""

    def __init__(self, array: np.ndarray, owner: object):
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], True)  # read-only
        self.__array_interface__ = interface
        self.owner = owner


def _check_manifest(root: Path, manifest: dict) -> None:
    """Validate every key of an index manifest (types, ranges, the format number), before any
    value reaches faiss.

    Raises:
        StorageError: naming the manifest file, the key and what was expected.
    """
    where = root / MANIFEST

    def bad(key: str, expected: str) -> StorageError:
        got = repr(manifest.get(key, "<missing>")) if "." not in key else repr(
            manifest["params"].get(key.split(".", 1)[1]))
        return StorageError(f"{where}: key {key!r} must be {expected}, got {got:.80}")

    missing = [key for key in _MANIFEST_KEYS if key not in manifest]
    if missing:
        raise StorageError(f"{where}: missing key(s) {missing}; an index manifest has "
                           f"{list(_MANIFEST_KEYS)} (written by DenseIndex.save)")
    unknown = sorted(set(manifest) - set(_MANIFEST_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise StorageError(f"{where}: unknown key(s) {unknown}; expected only "
                           f"{list(_MANIFEST_KEYS + _OPTIONAL_KEYS)}")
    if not isinstance(manifest.get("on_disk", False), bool):
        raise bad("on_disk", "true or false")
    fmt = manifest["format"]
    if isinstance(fmt, bool) or not isinstance(fmt, int):
        raise bad("format", f"the int {FORMAT}")
    if fmt != FORMAT:
        raise StorageError(f"{where}: key 'format' is {fmt}, this version of rag_fast reads index "
                           f"format {FORMAT} only (written by another version; rebuild the index)")
    for key in ("preset", "factory", "faiss_version"):
        if not isinstance(manifest[key], str) or not manifest[key]:
            raise bad(key, "a non-empty string")
    for key in ("count", "dim"):
        value = manifest[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(key, "an int >= 1")
    if manifest["metric"] != "inner_product":
        raise bad("metric", "'inner_product'")
    if not isinstance(manifest["meta"], dict):
        raise bad("meta", "an object")
    params = manifest["params"]
    if not isinstance(params, dict):
        raise bad("params", f"an object with keys among {list(SETTINGS)}")
    unknown = sorted(set(params) - set(SETTINGS))
    if unknown:
        raise StorageError(f"{where}: unknown key(s) {['params.' + u for u in unknown]}; "
                           f"expected among {['params.' + k for k in SETTINGS]}")
    if "rerank" not in params:
        raise StorageError(f"{where}: missing key 'params.rerank' (an int >= 1)")
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SETTING:
            raise bad(f"params.{key}", f"an int >= 1 and <= {MAX_SETTING}")
    if set(manifest["files"]) != {_INDEX_FILE, _VECTORS_FILE}:
        raise StorageError(f"{where}: key 'files' lists {sorted(manifest['files'])}, expected "
                           f"{sorted([_INDEX_FILE, _VECTORS_FILE])}")


class DenseIndex:
    """Inner-product index over ``N`` vectors of dimension ``d`` (rows are passage ids).

    Build with :meth:`build`, open with :meth:`load`. :meth:`search` is thread-safe (per-call
    parameters never touch shared state).
    """

    def __init__(self, base, vectors, preset: str, factory: str, params: dict, meta: dict | None = None,
                 source: Path | None = None, *, on_disk: bool = False):
        self._base = base  # the faiss index of the preset
        self._vectors = vectors  # faiss IndexScalarQuantizer(fp16): the exact vectors
        self.preset, self.factory, self.meta, self.source = preset, factory, dict(meta or {}), source
        self.params = dict(params)  # defaults: nprobe, ef_search, rerank
        #: whether the saved index.faiss is opened with its inverted lists memory-mapped
        #: (``build(on_disk=True)``; :attr:`lists_mapped` says whether this object's are)
        self.on_disk = bool(on_disk)
        # for mapped lists: a descriptor of the index.faiss that faiss mapped, and its manifest
        # entry (save copies that file instead of serialising lists faiss cannot write back)
        self._mapped_fd: int | None = None
        self._mapped_entry: dict | None = None
        self._ivf = extract_ivf(base)
        self._hnsw = isinstance(faiss.downcast_index(base), faiss.IndexHNSW)
        self._refine = faiss.IndexRefine(base, vectors) if self.params.get("rerank", 1) > 1 else None
        n, d = vectors.ntotal, vectors.d
        # The fp16 store's codes, viewed (not copied) as [N, d] float16. The view's base holds
        # the faiss store, so the array stays valid after this index is garbage-collected.
        if n:
            raw = np.asarray(_Owned(faiss.rev_swig_ptr(vectors.codes.data(), n * d * 2), vectors))
        else:
            raw = np.zeros(0, np.uint8)
        self.embeddings: np.ndarray = raw.view(np.float16).reshape(n, d)
        self.embeddings.flags.writeable = False
        self._gpu: tuple[str, object] | None = None
        self._gpu_device: torch.device | None = None  # where _gpu searches, and why torch does
        self._gpu_reason: str | None = None
        self._param_cache: dict[tuple, object] = {}

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        embeddings: np.ndarray | torch.Tensor | Sequence[np.ndarray],
        preset: str = "ivfpq",
        *,
        rerank: int | None = None,
        nprobe: int | None = None,
        ef_search: int | None = None,
        train_size: int | None = None,
        batch_size: int = 65536,
        seed: int = 0,
        progress: bool = True,
        meta: dict | None = None,
        on_disk: bool = False,
        target_recall: float | None = None,
        queries: np.ndarray | torch.Tensor | None = None,
        query_source: str | None = None,
    ) -> "DenseIndex":
        """Build an index over ``embeddings`` ``[N, d]`` (float numpy, memmap, tensor, or a list
        of such shards in row order).

        With ``target_recall`` the built index measures itself (:meth:`measure`): the cheapest
        search settings whose recall@10 against exact search, on ``queries`` ``[Q, d]`` when
        given (real question embeddings) or else on a seeded sample of the corpus's own vectors
        searched leave-one-out, reaches the target become its defaults, and the measured recall
        and speed are recorded in ``meta["search_quality"]``.

        Trains on ``train_size`` rows sampled with ``seed`` (default: enough for k-means, at
        most 2**17 unless the factory has more centroids), then adds in batches of
        ``batch_size`` with a progress bar.

        Before faiss allocates anything, the factory string is read and sized
        (:func:`factory_sizes`, :func:`check_corpus`): lists, PQ, HNSW and transform sizes
        within their bounds, at least one training vector per k-means centroid, and the
        estimated memory of the build within the memory available.

        Args:
            preset: ``"exact" | "hnsw" | "ivfpq"`` or a faiss factory string.
            rerank: candidates per result re-ranked exactly (``rerank * max(k, 10)`` are
                fetched, so a search for fewer than 10 has the quality :meth:`tune` measured); 1 or
                less turns re-ranking off. Default: 8 for ivfpq, off otherwise.
            nprobe, ef_search: default search parameters (see :meth:`search`, :meth:`tune`).
            on_disk: write the inverted lists so that :meth:`load` memory-maps them instead of
                reading them into RAM: with ``"ivfpq"`` the lists hold 8-bit PQ codes
                (``IVF{nlist},PQ{M}``, not fast-scan); a factory string must be an IVF
                without fast-scan (``"IVF4096,PQ64"``, ``"IVF4096,SQ8"``). Below
                :data:`SMALL_CORPUS` vectors ``ivfpq`` is exact search, with no lists.
                The build itself holds the codes in RAM (``M + 8`` bytes per vector for PQ).
        Raises:
            ValueError: empty or non-2-D ``embeddings``, NaN/inf rows, bad parameters,
                ``on_disk`` with ``"exact"``, ``"hnsw"`` or a factory faiss cannot map; a
                factory string with a size out of its bounds, more centroids than training
                vectors, or an estimated memory above what is available (naming ``preset``,
                the value, the bound and the corpus size).
        """
        n, d = corpus_shape(embeddings)
        if n == 0:
            raise ValueError(f"embeddings: the corpus is empty (shape [{n}, {d}]); expected N >= 1 rows")
        if d == 0:
            raise ValueError(f"embeddings: shape [{n}, {d}] has no dimensions; expected d >= 1")
        batch_size = check_int("batch_size", batch_size)
        if queries is not None and (len(getattr(queries, "shape", ())) != 2 or queries.shape[1] != d
                                    or queries.shape[0] == 0):
            raise ValueError(f"queries must have shape [Q >= 1, d={d}] (the embeddings' dimension), "
                             f"got {tuple(getattr(queries, 'shape', ()))}")
        if check_on_disk(on_disk) and preset in ("exact", "hnsw"):
            raise on_disk_error(preset, "it has no inverted lists (only an IVF index has)")
        if preset in PRESETS:
            factory, default_rerank = preset_factory(preset, n, d, on_disk)
        else:
            factory, default_rerank = preset, 1
        # every size in the factory string, checked against the corpus and the memory
        # available before faiss allocates any of it
        sizes = factory_sizes(preset, factory, d, n)
        train = default_train_points(sizes, n, None if train_size is None else
                                     check_int("train_size", train_size))
        check_corpus(preset, factory, sizes, n, d, train, batch_size,
                     reads_a_copy=reads_a_copy(embeddings))
        base = new_index(preset, factory, d)
        small = preset in PRESETS and factory == "Flat"  # ivfpq on a small corpus: exact, no lists
        if on_disk and not small and (reason := lists_mappable(base)) is not None:
            raise on_disk_error(preset, reason)
        on_disk = on_disk and not small
        rerank = default_rerank if rerank is None else check_int("rerank", rerank, 0)
        params = {"rerank": max(1, rerank)}
        ivf = extract_ivf(base)
        if ivf is not None:
            params["nprobe"] = (check_int("nprobe", nprobe) if nprobe is not None
                                else max(1, ivf.nlist // 64))
        if isinstance(base, faiss.IndexHNSW):
            params["ef_search"] = check_int("ef_search", ef_search) if ef_search is not None else 64

        vectors = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        if not base.is_trained:
            size = train
            rng = np.random.default_rng(seed)
            rows = np.sort(rng.choice(n, size=size, replace=False))
            sample = np.concatenate([corpus_rows(embeddings, int(r), int(r) + 1) for r in rows]) \
                if size < n // 4 else corpus_rows(embeddings, 0, n)[rows]
            try:
                check_finite("embeddings", sample)
            except NonFiniteError as e:  # the sample's row, as the corpus row it is
                row = int(rows[e.row])
                raise NonFiniteError(f"embeddings contain NaN or inf (row {row})", row) from None
            if progress:
                tqdm.write(f"training {factory} on {size} vectors")
            base.train(sample)
        for start in tqdm(range(0, n, batch_size), desc=f"adding ({factory})", unit=" batch",
                          disable=not progress):
            chunk = corpus_rows(embeddings, start, min(start + batch_size, n))
            check_finite("embeddings", chunk, offset=start)
            vectors.add(chunk)
            base.add(chunk)
        index = cls(base, vectors, preset, factory, params, meta, on_disk=on_disk)
        if target_recall is not None:
            index.measure(target_recall, tune=index.factory != "Flat", queries=queries,
                          query_source=query_source, progress=progress)
        return index

    def measure(self, target_recall: float = 0.95, *, tune: bool = True, k: int = 10,
                n_queries: int = 1000, queries=None, query_source: str | None = None,
                seed: int = 0, progress: bool = False) -> dict:
        """Search quality against exact search, after picking the cheapest settings that reach
        ``target_recall`` when ``tune`` (see :meth:`tune`); recorded in
        ``meta["search_quality"]`` (saved, shown by ``describe`` and ``rag-fast index info``).

        Queries: the given ``queries`` ``[Q, d]`` (real question embeddings where you have
        them; ``query_source`` says what they are), else a seeded sample of ``n_queries``
        stored vectors searched leave-one-out: each query's own row is left out of both its
        exact and its approximate results, so it stands for a new text near the corpus rather
        than a passage finding itself.

        Given ``queries`` fewer than :func:`min_tuning_queries` asks for ``target_recall``
        (59 for 0.95) raise a :class:`SmallSampleWarning`: not even all of them matching exact
        search would show the target with the tuner's 95% confidence.

        Returns:
            ``{"target_recall", "k", "queries", "query_source", "recall", "same_top5",
            "ms_per_query", "reached", "settings"}``: ``recall`` is recall@k, ``same_top5``
            the fraction of queries whose top 5 are exact search's top 5; ``reached`` says
            both are >= ``target_recall``.
        """
        quality = measure_quality(self, target_recall, tune=tune, k=k, n_queries=n_queries,
                                  queries=queries, query_source=query_source, seed=seed,
                                  progress=progress, **self._structure())
        self.meta = {**(self.meta or {}), "search_quality": quality}
        if not quality["reached"]:
            _warn_once(f"target-{id(self)}", f"no search setting of this {self.factory} index "
                       f"reaches recall@{k} and same top 5 of {target_recall} against exact search "
                       f"(best {quality['recall']}, {quality['same_top5']} at {quality['settings']}); "
                       "consider preset 'exact', another preset or factory, or a lower target")
        return quality

    def _structure(self) -> dict:
        """What the tuner sweeps (see :func:`~rag_fast.retrieval.tuning.tune_settings`): the
        IVF's lists (``nlist``, None without an IVF), ``hnsw``, and whether it ``reranks``."""
        return {"nlist": self._ivf.nlist if self._ivf is not None else None, "hnsw": self._hnsw,
                "reranks": self._refine is not None}

    # ---- properties -----------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return int(self._vectors.ntotal)

    def __len__(self) -> int:
        return self.ntotal

    @property
    def dim(self) -> int:
        return int(self._vectors.d)

    @property
    def faiss_index(self):
        """The faiss index :meth:`search` calls (IndexRefine over the preset when re-ranking)."""
        return self._refine if self._refine is not None else self._base

    def index_bytes(self) -> int:
        """Serialized size of the search structure, without the fp16 vectors beside it (for
        memory-mapped lists: the size of the file they are mapped from)."""
        if self._mapped_entry is not None:
            return int(self._mapped_entry["bytes"])
        return int(faiss.serialize_index(self._base).size)

    @property
    def lists_mapped(self) -> bool:
        """Whether this object's inverted lists are memory-mapped from ``index.faiss`` (an
        ``on_disk`` index opened with ``load(mmap=True)``) rather than held in RAM."""
        return self._ivf is not None and isinstance(
            faiss.downcast_InvertedLists(self._ivf.invlists), faiss.OnDiskInvertedLists)

    def describe(self) -> dict:
        """Preset, factory, size, search defaults and, when measured (:meth:`measure`, or
        ``build(target_recall=...)``), ``search_quality``: recall@k against exact search and
        milliseconds per query at those defaults.

        Also what :meth:`search` actually runs, worked out now (never saved: it depends on the
        installation and on :meth:`to`): ``searched_by``, ``{"cpu": "rag_fast.inner_products"
        | "faiss", "cuda": None | "faiss_gpu" | "torch_exact"}`` (``cuda``: CUDA queries after
        ``to("cuda")``; None before), and ``search``, the same in words, e.g. ``"faiss
        IVF4096,PQ64x4fs on the CPU; CUDA queries: exact, torch over the fp16 vectors on
        cuda:0, as faiss GPU has no version of 'IVF4096,PQ64x4fs' ..."``; with faiss GPU,
        ``"...; CUDA queries: faiss GPU IVF4096,PQ64 over 2 GPUs, re-ranked exactly over the fp16
        vectors"``."""
        cpu_by, cpu_words = self._cpu_search()
        cuda_by, words = None, cpu_words
        if self._gpu is not None:
            cuda_by = "faiss_gpu" if self._gpu[0] == "faiss" else "torch_exact"
            words = f"{cpu_words}; CUDA queries: {self._cuda_words(self._gpu_device, self._gpu_reason)}"
        return {"preset": self.preset, "factory": self.factory, "count": self.ntotal, "dim": self.dim,
                "metric": "inner_product", "params": dict(self.params), "faiss_version": faiss.__version__,
                "on_disk": self.on_disk, "search_quality": (self.meta or {}).get("search_quality"),
                "search": words, "searched_by": {"cpu": cpu_by, "cuda": cuda_by}}

    def _cpu_search(self) -> tuple[str, str]:
        """(``searched_by["cpu"]``, words) of :meth:`describe`: what a CPU search runs."""
        base = self._base
        if (self._refine is None and isinstance(base, faiss.IndexFlat)
                and base.metric_type == faiss.METRIC_INNER_PRODUCT):
            if _has_inner_products():
                return ("rag_fast.inner_products",
                        "exact, rag_fast's inner-product kernel over the fp32 vectors on the CPU")
            return ("faiss", "exact, faiss IndexFlatIP on the CPU (rag_fast's inner-product kernel "
                             "is missing: scores depend on the batch)")
        rerank = ", re-ranked exactly over the fp16 vectors" if self._refine is not None else ""
        return "faiss", f"faiss {self.factory} on the CPU{rerank}"

    def _cuda_words(self, device, reason: str | None) -> str:
        """What CUDA queries search: faiss GPU (sharded over every GPU it sees) where
        ``reason`` is None, else exact search with torch on ``device``, and ``reason``."""
        if reason is None:
            rerank = ", re-ranked exactly over the fp16 vectors" if self._refine is not None else ""
            n = faiss_gpu_count()
            return f"faiss GPU {self.factory} over {n} GPU{'s' if n > 1 else ''}{rerank}"
        return f"exact, torch over the fp16 vectors on {device}, as {reason}"

    def cuda_search(self) -> str:
        """What ``to("cuda")`` would make CUDA queries search, for this index type and this
        faiss build (in the words of ``describe()["search"]``): faiss GPU, or exact search
        with torch over the fp16 vectors, and why. Nothing moves; where faiss GPU then fails
        to hold the index, ``to`` falls back to torch and says so."""
        return self._cuda_words("cuda", self._gpu_refusal())

    def _gpu_refusal(self) -> str | None:
        """Why faiss GPU cannot search this index here (no GPU support, no GPU version of the
        index type), or None."""
        if faiss_gpu_count() == 0:
            return "faiss has no GPU support (pip install faiss-gpu to search IVF indexes on the GPU)"
        if not faiss_gpu_supports(self._base):
            return (f"faiss GPU has no version of {self.factory!r} (HNSW and fast-scan PQ stay on "
                    "the CPU; for faiss GPU build e.g. 'IVF4096,PQ64' or 'IVF4096,Flat')")
        return None

    # ---- search ---------------------------------------------------------------------------
    def search_parameters(self, k: int, nprobe: int | None = None, ef_search: int | None = None,
                          rerank: int | None = None):
        """faiss SearchParameters for one call (None -> the index defaults), cached: they are
        read-only once built, so concurrent searches share them.

        Raises:
            ValueError: naming ``k``, ``nprobe``, ``ef_search`` or ``rerank`` (a setting faiss
                would reject, or abort the process on, never reaches it).
        """
        k = check_int("k", k, 1, max(1, self.ntotal))
        nprobe = self._setting("nprobe", nprobe, self._ivf is not None)
        ef = self._setting("ef_search", ef_search, self._hnsw)
        if self._refine is None:
            if rerank is not None and check_int("rerank", rerank) > 1:
                raise ValueError("rerank: this index was built without re-ranking (rerank=1)")
            factor = None
        else:
            factor = self._rerank_candidates(k, self._setting("rerank", rerank, True)) / k
        key = (nprobe, max(ef, k) if ef else None, factor)
        params = self._param_cache.get(key)
        if params is None:
            params = self._make_parameters(*key)
            self._param_cache[key] = params
        return params

    def _rerank_candidates(self, k: int, rerank: int) -> int:
        """Candidates fetched for the exact re-rank of a top-``k`` search: ``rerank *
        max(k, RERANK_MIN_K)`` (at most the corpus). A search for fewer than 10 results
        re-ranks as many candidates as one for 10, so its results are the first ``k`` of
        that search, whose quality :meth:`tune` measured."""
        return max(k, min(self.ntotal, rerank * max(k, RERANK_MIN_K)))

    def _setting(self, name: str, value: int | None, used: bool) -> int | None:
        """A search setting given to a call (validated) or else the index default (validated
        too: ``params`` is public and :meth:`tune` or a caller may have changed it)."""
        if value is not None:
            return check_int(name, value)
        value = self.params.get(name)
        if value is None:
            if used:
                raise ValueError(f"{name}: this index has no default {name} (params={self.params}); "
                                 f"pass {name}=...")
            return None
        return check_int(f"params[{name!r}]", value)

    def _make_parameters(self, nprobe: int | None, ef: int | None, factor: float | None):
        base_params = None
        if self._ivf is not None:
            base_params = faiss.SearchParametersIVF(nprobe=min(nprobe, self._ivf.nlist))
        elif self._hnsw:
            base_params = faiss.SearchParametersHNSW(efSearch=ef)
        if factor is None:
            return base_params
        refine = faiss.IndexRefineSearchParameters(k_factor=float(factor))
        if base_params is not None:
            refine.base_index_params = base_params
            refine._base_params = base_params  # keep the Python object alive with its parent
        return refine

    def search(
        self,
        queries: np.ndarray | torch.Tensor,
        k: int,
        *,
        nprobe: int | None = None,
        ef_search: int | None = None,
        rerank: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray] | tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` inner products for each query.

        Args:
            queries: ``[B, d]`` floating numpy array or torch tensor (any device).
            k: results per query, ``1 <= k <= ntotal``.
            nprobe: inverted lists visited (IVF indexes); ef_search: HNSW beam width;
            rerank: candidates per result re-ranked exactly. None -> the index defaults.
        Returns:
            scores ``[B, k]`` float32 (descending) and ids ``[B, k]`` int64, numpy for numpy
            queries, tensors on the queries' device for torch queries. A slot with no result
            (possible with small ``nprobe``) has id -1 and score ``-inf``.
        Raises:
            ValueError: naming ``queries`` (type, shape, dimension, NaN/inf), ``k``, ``nprobe``,
                ``ef_search`` or ``rerank``.
        """
        q = check_queries(queries, k, self.dim, self.ntotal)
        is_torch = isinstance(q, torch.Tensor)
        if self._gpu is not None and is_torch and q.is_cuda:
            return self._search_gpu(q, k, nprobe, ef_search, rerank)
        q_np = q.to("cpu", torch.float32).numpy() if is_torch else q
        q_np = np.ascontiguousarray(q_np, dtype=np.float32)
        check_finite("queries", q_np)
        params = self.search_parameters(k, nprobe, ef_search, rerank)
        flat = self._flat_vectors()
        if flat is not None:  # the exact preset: rag_fast's kernel over faiss's own vectors
            s_t, i_t = exact_search(flat, torch.from_numpy(q_np), k, chunk=FLAT_CHUNK,
                                    per_pair=True)
            del flat
            if bool((s_t[:, 1:] == s_t[:, :-1]).any()):  # equal scores by descending id,
                i_t, order = i_t.sort(dim=1, descending=True)  # as faiss lists them
                s_t = s_t.gather(1, order)
                s_t, order = s_t.sort(dim=1, descending=True, stable=True)
                i_t = i_t.gather(1, order)
            scores, ids = s_t.numpy(), i_t.numpy()
        else:
            scores, ids = self.faiss_index.search(q_np, k, params=params)
        _mark_missing(scores, ids)
        if is_torch:
            return torch.from_numpy(scores).to(q.device), torch.from_numpy(ids).to(q.device)
        return scores, ids

    def _flat_vectors(self) -> torch.Tensor | None:
        """The fp32 vectors of an exact inner-product index (``Flat``, no re-rank: the
        ``exact`` preset, and ``ivfpq``/``hnsw`` on a small corpus), viewed ``[N, d]`` in
        faiss's own memory (no copy), for :meth:`search`; None for any other index.

        Searched with :func:`exact_search` and rag_fast's inner-product kernel
        (:func:`rag_fast.ops.inner_products.inner_products`, ``per_pair=True``) per block of
        :data:`FLAT_CHUNK` vectors, so that a pair's score depends neither on the batch it is
        in nor on how the corpus is cut into shards. faiss's ``IndexFlatIP`` scores pair by
        pair only below ``queries x d = faiss.cvar.distance_compute_blas_threshold`` (128 000
        in faiss 1.15: 166 queries of 768) and by a BLAS product above it, whose rounding may
        change with the shapes. Which of the two is faster depends on the batch and the corpus
        (measured in ``docs/retrieval.md`` and the exact rows of the index bench). The
        same top-k by score; equal scores listed by descending id, as faiss lists them (which
        of several vectors tied at the k-th place is kept is unspecified, as with faiss:
        :func:`rag_fast.retrieval.sharded.search_exact_ties` decides them). None without the
        kernel (no compiled extension, or one built from older sources): faiss searches then,
        said once per process in a warning (:func:`_flat_fallback_message`), since scores then
        depend on the batch. The view is taken anew for each search, never kept: faiss owns
        that memory."""
        base = self._base
        if (self._refine is not None or not isinstance(base, faiss.IndexFlat)
                or base.metric_type != faiss.METRIC_INNER_PRODUCT or base.ntotal == 0):
            return None
        if not _has_inner_products():
            _warn_once("flat-without-kernel", _flat_fallback_message(), stacklevel=4)
            return None
        n, d = int(base.ntotal), int(base.d)
        raw = faiss.rev_swig_ptr(base.codes.data(), n * d * 4)  # uint8, faiss's memory
        return torch.from_numpy(raw).view(torch.float32).view(n, d)

    # ---- GPU ------------------------------------------------------------------------------
    def to(self, device: str | torch.device) -> "DenseIndex":
        """Search CUDA queries on ``device`` from now on (``"cpu"`` goes back).

        Where faiss has GPU support and a GPU version of this index type (flat, IVF-Flat,
        IVF-PQ with 8-bit codes, IVF-SQ: see :func:`faiss_gpu_supports`), the index moves to
        faiss GPU (sharded over all GPUs, full-precision tables) and searches with the same
        settings as on the CPU (``nprobe``) and the same exact re-rank (``rerank * max(k, 10)``
        candidates re-scored against the fp16 vectors, kept on the GPU): the same ids as
        on the CPU, up to ties. Every other case (faiss-cpu, HNSW, fast-scan PQ such as the
        ``ivfpq`` preset) searches exactly with torch over the fp16 vectors on the GPU, said
        once in a warning: at least as good as the CPU results, not the same ids.
        ``describe()["search"]`` then says which (:meth:`cuda_search` says it beforehand).

        Raises:
            ValueError: ``device`` is neither ``"cpu"`` nor an available CUDA device.
        """
        device = torch.device(device)
        if device.type == "cpu":
            self._gpu = self._gpu_device = self._gpu_reason = None
            return self
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"device must be 'cpu' or an available CUDA device, got {device}")
        return self._attach(device)

    def _attach(self, device: torch.device) -> "DenseIndex":
        """Move the search to ``device`` (``to`` checks it is CUDA; tests stand in another)."""
        vectors = torch.from_numpy(np.ascontiguousarray(self.embeddings)).to(device)  # [N, d] fp16
        reason = self._gpu_refusal()
        if reason is None:
            try:
                options = faiss.GpuMultipleClonerOptions()
                options.shard, options.useFloat16 = True, False
                self._gpu = ("faiss", faiss.index_cpu_to_all_gpus(self._base, co=options), vectors)
                self._gpu_device, self._gpu_reason = vectors.device, None
                return self
            except RuntimeError as exc:
                reason = f"faiss GPU cannot hold {self.factory!r} ({str(exc).strip().splitlines()[-1]})"
        _warn_once(f"gpu-{self.factory}-{reason}", f"{reason}: CUDA queries are searched exactly with "
                   "torch over the fp16 vectors on the GPU (ids may differ from the CPU index's "
                   "approximate results; recall 1.0 against exact search)")
        self._gpu = ("torch", None, vectors)
        self._gpu_device, self._gpu_reason = vectors.device, reason
        return self

    def _search_gpu(self, q: torch.Tensor, k: int, nprobe, ef_search, rerank):
        kind, gpu_index, vectors = self._gpu
        if not bool(torch.isfinite(q).all()):
            raise ValueError("queries contain NaN or inf")
        q = q.to(vectors.device, torch.float32).contiguous()
        if kind == "torch" or k > GPU_MAX_K:
            return exact_search(vectors, q, k, chunk=1 << 20)
        self._setting("ef_search", ef_search, False)  # validated, as on the CPU
        params = None
        if self._ivf is not None:
            nprobe = self._setting("nprobe", nprobe, True)
            params = faiss.SearchParametersIVF(nprobe=min(nprobe, GPU_MAX_K, self._ivf.nlist))
        if self._refine is None:
            if rerank is not None and check_int("rerank", rerank) > 1:
                raise ValueError("rerank: this index was built without re-ranking (rerank=1)")
            scores, ids = search_tensor(gpu_index, q, k, params)
            scores = torch.where(ids < 0, torch.full_like(scores, -math.inf), scores)
            return scores, ids
        # the CPU's IndexRefine: rerank * max(k, 10) candidates, re-scored exactly on the fp16 vectors
        n_cand = min(self._rerank_candidates(k, self._setting("rerank", rerank, True)), GPU_MAX_K)
        _, cand = search_tensor(gpu_index, q, n_cand, params)  # [B, n_cand]
        exact = torch.einsum("bd,bcd->bc", q, vectors[cand.clamp_min(0)].float())
        exact = torch.where(cand < 0, torch.full_like(exact, -math.inf), exact)
        scores, pos = exact.topk(k, dim=1)
        ids = torch.where(torch.isinf(scores), torch.full_like(pos, -1), cand.gather(1, pos))
        return scores, ids

    # ---- tuning ---------------------------------------------------------------------------
    def tune(
        self,
        target_recall: float = 0.95,
        queries: np.ndarray | torch.Tensor | None = None,
        k: int = 10,
        n_queries: int = 1000,
        rerank_factors: Sequence[int] = RERANK_FACTORS,
        seed: int = 0,
    ) -> dict:
        """Pick the fastest ``nprobe`` (IVF) or ``ef_search`` (HNSW), and re-rank factor, whose
        search on ``queries`` reaches ``target_recall`` against exact search twice over: as
        recall@k, and as the fraction of queries whose top 5 are exact search's top 5 (what a
        retriever of 5 passages hands on), each with 95% confidence over the queries (its
        one-sided lower bound must reach the target); make it the default and return it.
        Given ``queries`` fewer than :func:`min_tuning_queries` asks for ``target_recall`` (59
        for 0.95) raise a :class:`SmallSampleWarning`: on so few, not even a perfect result
        shows the target with that confidence.

        Args:
            queries: ``[Q, d]`` queries (real question embeddings where you have them); None ->
                ``n_queries`` stored vectors (seeded), searched leave-one-out (see :meth:`measure`).
            rerank_factors: the re-rank factors tried (:data:`RERANK_FACTORS`: up to 64, i.e.
                640 candidates re-scored for a top 10).
        Returns:
            ``{"nprobe" | "ef_search", "rerank", "recall", "same_top5", "ms_per_query",
            "reached"}``; ``reached`` is False when no setting got there (the best is kept).
        Raises:
            ValueError: naming ``target_recall``, ``queries``, ``k``, ``n_queries`` or
                ``rerank_factors``.
        """
        return tune_settings(self, target_recall, queries, k, n_queries, rerank_factors, seed,
                             **self._structure())

    # ---- persistence ----------------------------------------------------------------------
    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write ``path/`` (index.faiss, vectors.faiss, manifest.json) atomically.

        An index whose lists are memory-mapped is saved by copying the file they are mapped
        from (held open since :meth:`load`, so a later replacement of that path does not
        matter), streamed, and checked against the checksum its manifest gave at load.

        A full disk is one error naming the file, the bytes it needs and the bytes free (the
        copy of mapped lists is allocated on disk before it is written); the temporary
        directory is removed and ``path`` is left as it was.

        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is False.
            StorageError: the mapped ``index.faiss`` no longer matches its manifest's checksum
                (changed in place since it was loaded); nothing is written.
            NoSpaceError: (an ``OSError``, errno ``ENOSPC``) the disk has no room for the
                index; nothing is written.
        """
        shown = Path(path)
        try:
            with atomic_directory(path, overwrite, kind=INDEX_KIND) as tmp:
                if self._mapped_fd is not None:
                    self._copy_mapped(tmp / _INDEX_FILE, shown / _INDEX_FILE)
                else:
                    write_faiss(self._base, tmp / _INDEX_FILE, shown / _INDEX_FILE)
                write_faiss(self._vectors, tmp / _VECTORS_FILE, shown / _VECTORS_FILE)
                # the manifest's keys only (search_quality is in meta; what search runs is
                # worked out at load, never saved)
                described = {k: v for k, v in self.describe().items()
                             if k in _MANIFEST_KEYS + _OPTIONAL_KEYS}
                files = describe_files(tmp, [_INDEX_FILE, _VECTORS_FILE])
                if self._mapped_entry is not None and files[_INDEX_FILE] != self._mapped_entry:
                    raise StorageError(f"{self.source / _INDEX_FILE}, whose inverted lists this index "
                                       "memory-maps, no longer matches the checksum of its manifest "
                                       "(changed on disk since it was loaded); reload or rebuild the index")
                manifest = {"kind": INDEX_KIND, "format": FORMAT, **described, "meta": self.meta,
                            "files": files}
                write_manifest(tmp / MANIFEST, manifest)
        except OSError as exc:  # a full disk while writing the manifest, or creating a file
            raise no_space(exc, shown) from None
        return shown

    def _copy_mapped(self, dest: Path, shown: Path) -> None:
        """Stream the open file the inverted lists are mapped from to ``dest`` (the file
        ``shown`` in messages), its size allocated on disk first."""
        fd, offset = self._mapped_fd, 0
        with open(dest, "wb", buffering=0) as out:
            reserve_space(out.fileno(), shown, os.fstat(fd).st_size)
            try:
                while chunk := os.pread(fd, _WRITE_CHUNK, offset):
                    write_all(out.fileno(), chunk)
                    offset += len(chunk)
            except OSError as exc:
                raise no_space(exc, shown, os.fstat(fd).st_size) from None

    @classmethod
    def load(cls, path: str | Path, verify: bool = True, expected_dim: int | None = None,
             mmap: bool = True) -> "DenseIndex":
        """Open a saved index; the fp16 vectors are memory-mapped when ``mmap`` (and faiss can),
        and so are the inverted lists of an index built with ``on_disk=True`` (faiss
        ``IO_FLAG_MMAP``: the coarse quantiser and codebooks are read, the lists' codes and
        ids stay in ``index.faiss``; see :attr:`lists_mapped`).

        Args:
            verify: check every file's SHA-256 (sizes are always checked).
            mmap: False reads everything into RAM (an ``on_disk`` index too).
            expected_dim: raise unless the index has this dimension (e.g. the encoder's).
        Raises:
            StorageError: missing, truncated, corrupt, or inconsistent with its manifest.
            StorageError: also a manifest with a missing, unknown or malformed key, an
                out-of-range search setting, or another format number (naming file and key).
            ValueError: ``expected_dim`` differs from the index dimension.
        Warns:
            RuntimeWarning: once per faiss version, when the index was built with another.
        """
        root = Path(path)
        manifest = read_manifest(root, INDEX_KIND, verify, formats=None)  # checked below
        _check_manifest(root, manifest)
        d, n = manifest["dim"], manifest["count"]
        if manifest["faiss_version"] != faiss.__version__:
            _warn_once(f"faiss-version-{manifest['faiss_version']}",
                       f"index {str(root)!r} was built with faiss {manifest['faiss_version']}, this is "
                       f"faiss {faiss.__version__}: it loads, but if searches fail or results "
                       "change, rebuild the index with this faiss (said once per version)")
        if expected_dim is not None and expected_dim != d:
            raise ValueError(f"expected_dim={expected_dim} does not match the index dimension {d} "
                             f"of {str(root)!r} (built with another encoder?)")
        flag = getattr(faiss, "IO_FLAG_MMAP_IFC", 0) if mmap else 0
        on_disk = manifest.get("on_disk", False)
        mapped_fd = None  # closed here unless handed to the index (which closes it when collected)
        try:
            try:
                if on_disk and mmap:
                    # faiss maps the file it opens: open it first and let faiss open that very
                    # file (/proc/self/fd), so the mapped lists and what save() copies are one file
                    mapped_fd = os.open(root / _INDEX_FILE, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    if os.fstat(mapped_fd).st_size != manifest["files"][_INDEX_FILE]["bytes"]:
                        raise StorageError(f"{root / _INDEX_FILE} changed size while it was opened")
                    by_fd = f"/proc/self/fd/{mapped_fd}"
                    base = faiss.read_index(by_fd if os.path.exists(by_fd) else str(root / _INDEX_FILE),
                                            faiss.IO_FLAG_MMAP)
                else:
                    base = faiss.read_index(str(root / _INDEX_FILE))
                vectors = faiss.read_index(str(root / _VECTORS_FILE), flag)
            except RuntimeError as exc:
                raise StorageError(f"faiss cannot read the index under {str(root)!r}: "
                                   f"{str(exc).strip().splitlines()[-1]}") from None
            if on_disk and (reason := lists_mappable(base)) is not None:
                raise StorageError(f"{root / MANIFEST}: key 'on_disk' is true but {root / _INDEX_FILE} "
                                   f"holds a {manifest['factory']!r} index and {reason}")
            for name, idx in ((_INDEX_FILE, base), (_VECTORS_FILE, vectors)):
                if idx.d != d or idx.ntotal != n:
                    raise StorageError(f"{root / name} holds {idx.ntotal} x {idx.d} vectors, the manifest "
                                       f"says {n} x {d} (dimension mismatch or mixed-up files)")
            if not isinstance(vectors, faiss.IndexScalarQuantizer) or vectors.code_size != 2 * d:
                raise StorageError(f"{root / _VECTORS_FILE} is not an fp16 vector store")
            try:
                is_ivf = faiss.extract_index_ivf(base) is not None
            except RuntimeError:
                is_ivf = False
            for key, needed in (("nprobe", is_ivf), ("ef_search", isinstance(faiss.downcast_index(base),
                                                                             faiss.IndexHNSW))):
                if needed and key not in manifest["params"]:
                    raise StorageError(f"{root / MANIFEST}: missing key 'params.{key}' (an int >= 1), "
                                       f"which a {manifest['factory']!r} index needs")
            check_recorded_factory(root / MANIFEST, root / _INDEX_FILE, manifest, base)
            index = cls(base, vectors, manifest["preset"], manifest["factory"], manifest["params"],
                        manifest.get("meta"), source=root, on_disk=on_disk)
            if mapped_fd is not None:
                if not index.lists_mapped:
                    raise StorageError(f"faiss read the inverted lists of {root / _INDEX_FILE} into "
                                       f"RAM instead of memory-mapping them (faiss {faiss.__version__}); "
                                       "open it with mmap=False")
                # faiss starts 32 threads per search to page the probed lists in ahead of the
                # scan; here a search pages them in on its own thread(s) as it reads them
                faiss.downcast_InvertedLists(index._ivf.invlists).prefetch_nthread = _PREFETCH_THREADS
                index._mapped_entry = dict(manifest["files"][_INDEX_FILE])
                weakref.finalize(index, os.close, mapped_fd)
                index._mapped_fd, mapped_fd = mapped_fd, None
        finally:
            if mapped_fd is not None:
                os.close(mapped_fd)
        return index


def _has_inner_products() -> bool:
    """The compiled extension is loaded and has the exact preset's kernel (an extension built
    from older sources lacks it until rebuilt)."""
    return _ext.available() and hasattr(_ext.get(), "inner_products")


def _flat_fallback_message() -> str:
    """The warning of an exact search without rag_fast's inner-product kernel: why, what it
    changes, the fix."""
    why = (f"the C++ extension does not load: {_ext.error()}" if not _ext.available() else
           "rag_fast._C has no inner_products: it was built from older sources")
    return (f"exact index searched with faiss IndexFlatIP instead of rag_fast's inner-product "
            f"kernel ({why}). A pair's score then depends on the batch it is searched in (faiss "
            "scores by a BLAS product above queries x d = faiss.cvar.distance_compute_blas_threshold), "
            "so a ShardedIndex's exact results may differ from one index's in ties and last bits. "
            "Fix: reinstall rag_fast so the extension is compiled, `pip install .` (`pip install "
            "-e .` in a checkout; Python started in the repository root imports the source folder, "
            "which has no extension unless built in place). Said once per process.")


def _mark_missing(scores: np.ndarray, ids: np.ndarray) -> None:
    missing = ids < 0
    if missing.any():
        scores[missing] = -np.inf
