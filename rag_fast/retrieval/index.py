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

import errno
import importlib
import math
import numbers
import os
import re
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_fast import _ext
from rag_fast.retrieval._exact import exact_search
from rag_fast.storage import (
    MANIFEST,
    NoSpaceError,
    StorageError,
    atomic_directory,
    describe_files,
    disk_free,
    no_space,
    read_manifest,
    reserve_space,
    write_manifest,
)


class _LazyFaiss:
    """The ``faiss`` module, imported at its first use. Everything that builds, loads or
    searches an index needs faiss; what only trains or decodes (``rag_fast.models``,
    ``rag_fast.training``) imports this package without it, as on a GPU machine whose image
    has no faiss. The first attribute read replaces this object by the module itself."""

    def __getattr__(self, name: str):
        global faiss
        try:
            module = importlib.import_module("faiss")
        except ImportError as e:
            raise ImportError(f"rag_fast's index needs faiss, which does not import ({e}): "
                              "pip install faiss-cpu, or a faiss build for your GPU") from e
        faiss = module
        return getattr(module, name)


faiss = _LazyFaiss()

INDEX_KIND = "rag_fast.dense_index"
FORMAT = 1
PRESETS = ("exact", "hnsw", "ivfpq")
# Re-rank factors :meth:`DenseIndex.tune` tries. Up to 64: on real text (14,708 documentation
# passages embedded with all-MiniLM-L6-v2, the index bench's corpus) the ivfpq preset's 4-bit
# PQ ranks near-duplicate passages too coarsely for the true top 5 to survive among 160
# candidates: with factors up to 16 no setting reached recall@10 and same top 5 of 0.95 even
# probing every list (0.941 / 0.865 at nprobe = nlist = 128), with 64 nprobe 64 does (0.988 /
# 0.959 on held-out queries, 0.034 ms per query against 0.108 for exact search).
RERANK_FACTORS = (1, 2, 4, 8, 16, 32, 64)
FLAT_CHUNK = 1 << 16  # vectors per matmul of the exact preset's search (see _flat_vectors)
SMALL_CORPUS = 39 * 16  # below: every preset is exact search (k-means of 16 lists needs 624)
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


def faiss_gpu_count() -> int:
    """Number of GPUs faiss can use (0 for faiss-cpu)."""
    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def faiss_gpu_supports(index) -> bool:
    """Whether faiss GPU has a version of this CPU index: flat, IVF-Flat, IVF-PQ with 8-bit
    codes and IVF-SQ do; HNSW, fast-scan PQ (the ``ivfpq`` preset) and the rest do not."""
    index = faiss.downcast_index(index)
    if type(index) is faiss.IndexIVFPQ:
        return index.pq.nbits == 8
    return type(index) in (faiss.IndexFlat, faiss.IndexFlatIP, faiss.IndexIVFFlat,
                           faiss.IndexIVFScalarQuantizer)


def preset_factory(preset: str, n: int, d: int, on_disk: bool = False) -> tuple[str, int]:
    """(faiss factory string, default re-rank factor) of a preset for ``n`` vectors of ``d``.

    ivfpq: ``nlist`` is the power of two nearest ``sqrt(n)`` (but at most ``n / 39`` so that
    k-means has 39 points per centroid) and the PQ has ``M`` 4-bit sub-quantisers with
    ``d / M`` near 8 (the largest even divisor of ``d`` up to ``d / 8``). With ``on_disk``
    the same lists hold plain 8-bit PQ codes (``M``: the largest divisor of ``d`` up to
    ``d / 8``), which faiss can memory-map; fast-scan blocks it cannot.

    Presets adapt to the corpus size: below :data:`SMALL_CORPUS` vectors (where exact search
    takes well under a millisecond and a quantiser has too little to train on) ``ivfpq`` and
    ``hnsw`` are exact search, so no preset fails on a small corpus.
    """
    if preset == "exact" or (preset in ("ivfpq", "hnsw") and n < SMALL_CORPUS):
        return "Flat", 1
    if preset == "hnsw":
        return "HNSW32", 1
    if preset == "ivfpq":
        nlist = 2 ** round(math.log2(max(1.0, math.sqrt(n))))
        nlist = max(1, min(nlist, 2 ** int(math.log2(max(1, n // 39)))))
        if on_disk:
            m = next(m for m in range(max(1, d // 8), 0, -1) if d % m == 0)
            return f"IVF{nlist},PQ{m}", 8
        m = next((m for m in range(max(2, d // 8), 0, -1) if d % m == 0 and m % 2 == 0), 1)
        return f"IVF{nlist},PQ{m}x4fs", 8
    raise ValueError(f"preset must be one of {PRESETS} or a faiss factory string, got {preset!r}")


def _check_on_disk(on_disk: object) -> bool:
    if not isinstance(on_disk, bool):
        raise ValueError(f"on_disk must be True or False, got {on_disk!r}")
    return on_disk


def _extract_ivf(index):
    """The IVF inside a faiss index, or None when it has none."""
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def lists_mappable(index) -> str | None:
    """None when faiss can memory-map the inverted lists of ``index`` (an IVF whose lists are
    faiss's plain array lists, written contiguously by ``write_index``), else the reason."""
    ivf = _extract_ivf(index)
    if ivf is None:
        return "it has no inverted lists (only an IVF index has)"
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    if isinstance(lists, faiss.BlockInvertedLists):
        return "its lists are fast-scan blocks, which faiss always reads into RAM"
    if not isinstance(lists, (faiss.ArrayInvertedLists, faiss.OnDiskInvertedLists)):
        return f"faiss keeps its lists as {type(lists).__name__}, which it cannot memory-map"
    return None


def _on_disk_error(preset: str, reason: str) -> ValueError:
    return ValueError(f"on_disk=True: preset {preset!r} cannot keep inverted lists on disk: {reason}; "
                      "use preset 'ivfpq' (8-bit PQ lists with on_disk) or an IVF factory without "
                      "fast-scan, e.g. 'IVF4096,PQ64' or 'IVF4096,SQ8'")


# ---- factory strings: sized before faiss allocates anything ---------------------------------
#
# faiss allocates part of an index when it parses the factory string (an empty inverted list
# costs about 160 bytes, so "IVF99999999,Flat" is 16 GB before any check of its own; a PQ's
# centroid table is d * 2**nbits floats) and the rest when it trains and adds. rag_fast reads
# the string first, with the grammar of faiss's index_factory, and checks every size in it
# against the bounds below, the corpus and the memory available.

MAX_LISTS = 1 << 22  # inverted lists of an IVF (faiss's guidelines stop at 2**20 for 1e9 vectors)
HNSW_DEGREES = (2, 1024)  # HNSW{M}: the graph degree (each vector links to 2 * M on level 0)
PQ_BITS = (1, 16)  # bits per PQ sub-quantiser code: 2**16 centroids at most (faiss: 24)
FAST_SCAN_BLOCK = (32, 4096)  # PQ{M}x4fs_{bbs}: vectors per block, a multiple of 32
KMEANS_POINTS_PER_CENTROID = 39  # below this faiss's k-means warns (it needs at least 1)
_OPQ_CENTROIDS = 256  # OPQ trains an 8-bit PQ
_FAISS_INT = 2**31 - 1  # faiss reads the numbers of a factory string as C ints
_LIST_BYTES = 160  # what faiss allocates per empty inverted list (ids and codes of each)
_SQ_BITS = {"SQ4": 4, "SQ6": 6, "SQ8": 8, "SQfp16": 16, "SQbf16": 16, "SQ8_direct": 8,
            "SQ8_direct_signed": 8}
_SIZED = ("transforms PCA{d'}, OPQ{M}[_{d'}], RR[{d'}], Pad{d'}, L2norm; codes Flat, "
          f"{', '.join(_SQ_BITS)}, PQ{{M}}[x{{bits}}][np], PQ{{M}}x4fs[_{{block}}]; HNSW{{M}} over "
          "Flat, SQ or PQ codes; IVF{lists} or IVF{lists}_HNSW{M} over Flat, FlatDedup, SQ or PQ "
          "codes; a trailing ,RFlat or ,Refine(...)")


class FactorySizes:
    """What a faiss factory string allocates, read from the string alone (see
    :func:`factory_sizes`): the dimension after its transforms, its inverted lists, the
    training vectors it needs at least, the bytes faiss allocates when it parses the string
    (``construct``), and the bytes of the built index: ``fixed`` whatever the corpus,
    ``per_vector`` per indexed vector and ``per_train`` per training vector (each a
    ``{part: bytes}`` dict)."""

    def __init__(self, dim: int):
        self.dim = dim
        self.nlist: int | None = None
        self.trains = False  # whether faiss trains it (then on a sample of the corpus)
        # (training vectors needed, what needs them, what to use instead given the vectors)
        self.needs: list[tuple[int, str, object]] = []
        self.construct = 0
        self.fixed: dict[str, int] = {}
        self.per_vector: dict[str, int] = {}
        self.per_train: dict[str, int] = {}

    def add(self, part: str, fixed: int = 0, per_vector: int = 0, per_train: int = 0) -> None:
        for table, value in ((self.fixed, fixed), (self.per_vector, per_vector),
                             (self.per_train, per_train)):
            if value:
                table[part] = table.get(part, 0) + int(value)

    def merge(self, other: FactorySizes) -> FactorySizes:
        self.nlist = self.nlist if self.nlist is not None else other.nlist
        self.trains = self.trains or other.trains
        self.needs += other.needs
        self.construct += other.construct
        for part, value in other.fixed.items():
            self.add(part, fixed=value)
        for part, value in other.per_vector.items():
            self.add(part, per_vector=value)
        for part, value in other.per_train.items():
            self.add(part, per_train=value)
        return self

    @property
    def train_min(self) -> int:
        """Training vectors faiss needs at least (one per centroid of each k-means)."""
        return max([count for count, _, _ in self.needs], default=1)

    def estimate(self, n: int, train: int) -> dict[str, int]:
        """``{part: bytes}`` of the index over ``n`` vectors trained on ``train``."""
        parts = dict(self.fixed)
        for part, value in self.per_vector.items():
            parts[part] = parts.get(part, 0) + value * n
        for part, value in self.per_train.items():
            parts[part] = parts.get(part, 0) + value * train
        return parts


def _bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # not reached


def available_memory() -> tuple[int, str] | None:
    """(bytes of memory a build may still allocate, where that figure comes from), or None
    where the system says nothing: ``MemAvailable`` of ``/proc/meminfo`` (else free physical
    pages), lowered to what a cgroup v2 memory limit leaves (its usage less its file cache)."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = (int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
                    break
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical memory")
        except (AttributeError, OSError, ValueError):
            pass
    try:
        root = Path("/sys/fs/cgroup")
        limit = (root / "memory.max").read_text().strip()
        if limit != "max":
            used = int((root / "memory.current").read_text())
            stat = dict(line.split() for line in (root / "memory.stat").read_text().splitlines())
            left = int(limit) - used + int(stat.get("file", 0))
            if found is None or left < found[0]:
                found = (max(0, left), "the cgroup memory limit (memory.max)")
    except (OSError, ValueError):
        pass
    return found


def _number(text: str, label: str) -> int:
    value = int(text)
    if value > _FAISS_INT:
        raise ValueError(f"{label}: {value} is larger than faiss reads (at most {_FAISS_INT})")
    return value


def _pq_sizes(sizes: FactorySizes, part: str, m: int, nbits: int, d: int, label: str,
              in_ivf: bool, fast_scan_block: int | None = None) -> None:
    """Check and add a PQ of ``m`` sub-quantisers of ``nbits`` bits over ``d`` dimensions."""
    if m < 1 or d % m:
        divisors = [k for k in range(1, d + 1) if d % k == 0]
        near = sorted(divisors, key=lambda k: abs(k - m))[:4]
        raise ValueError(f"{label}: {part} has M={m} sub-quantisers, which must divide the "
                         f"dimension d={d} (e.g. M in {sorted(near)})")
    if not PQ_BITS[0] <= nbits <= PQ_BITS[1]:
        raise ValueError(f"{label}: {part} has {nbits}-bit codes; rag_fast builds "
                         f"{PQ_BITS[0]} to {PQ_BITS[1]} bits per sub-quantiser "
                         f"(2**{PQ_BITS[1]} = {2**PQ_BITS[1]} centroids)")
    ksub = 2**nbits
    sizes.trains = True
    sizes.needs.append((ksub, f"{part} has 2**{nbits} = {ksub} centroids per sub-quantiser",
                        lambda t: f"use at most {max(1, t.bit_length() - 1)} bits "
                                  f"(PQ{m}x{max(1, t.bit_length() - 1)})"))
    sizes.construct += d * ksub * 4  # faiss allocates the centroid table with the quantiser
    sizes.add("PQ centroid tables", fixed=d * ksub * 4)
    if fast_scan_block is None:
        code = (m * nbits + 7) // 8
    else:
        if fast_scan_block % 32 or not FAST_SCAN_BLOCK[0] <= fast_scan_block <= FAST_SCAN_BLOCK[1]:
            raise ValueError(f"{label}: {part} has blocks of {fast_scan_block} vectors; fast-scan "
                             f"blocks are a multiple of 32 from {FAST_SCAN_BLOCK[0]} to "
                             f"{FAST_SCAN_BLOCK[1]}")
        code = (m + m % 2) // 2
        # each list (or the whole index) is padded to whole blocks
        sizes.add("PQ block padding", fixed=(sizes.nlist or 1) * fast_scan_block * code)
    sizes.add("codes and ids" if in_ivf else "codes", per_vector=code + (8 if in_ivf else 0))


def _code_sizes(spec: str, d: int, label: str, *, in_ivf: bool, nlist: int | None = None,
                in_hnsw: bool = False) -> FactorySizes | None:
    """The codes of a flat store, an HNSW or an IVF (``spec`` after the comma), or None when
    ``spec`` is none of those rag_fast sizes."""
    sizes = FactorySizes(d)
    sizes.nlist = nlist
    ids = 8 if in_ivf else 0
    where = "codes and ids" if in_ivf else "codes"
    if spec == "Flat" or (in_ivf and spec == "FlatDedup") or (in_hnsw and spec == ""):
        sizes.add(where, per_vector=4 * d + ids)
        return sizes
    if spec.startswith("SQ"):
        if spec not in _SQ_BITS:
            raise ValueError(f"{label}: {spec!r} is not a faiss scalar quantiser; faiss has "
                             f"{', '.join(_SQ_BITS)}")
        sizes.trains = spec not in ("SQfp16", "SQbf16")
        sizes.add(where, per_vector=(_SQ_BITS[spec] * d + 7) // 8 + ids)
        return sizes
    if m := re.fullmatch(r"PQ(\d+)(?:x(\d+))?(np)?", spec):
        _pq_sizes(sizes, spec, _number(m[1], label), _number(m[2], label) if m[2] else 8, d,
                  label, in_ivf)
        return sizes
    if (m := re.fullmatch(r"PQ(\d+)x4fs(r?)(?:_(\d+))?", spec)) and not in_hnsw:
        if m[2] and not in_ivf:
            return None
        _pq_sizes(sizes, spec, _number(m[1], label), 4, d, label, in_ivf,
                  fast_scan_block=_number(m[3], label) if m[3] else 32)
        return sizes
    return None


def _unsized(part: str, d: int, label: str, in_ivf: bool = False) -> FactorySizes:
    """A part rag_fast does not size: one without numbers (e.g. ``RaBitQ``) goes to faiss,
    which parses it or says why not, and is estimated as flat codes; one with numbers is
    refused, since its numbers may be sizes faiss allocates."""
    if re.search(r"\d", part):
        raise ValueError(f"{label}: {part!r} is not a part of a faiss factory string that "
                         f"rag_fast sizes before faiss allocates it; rag_fast sizes {_SIZED} "
                         f"(or use a preset {PRESETS})")
    sizes = FactorySizes(d)
    sizes.add("codes (estimated as flat vectors)", per_vector=4 * d + (8 if in_ivf else 0))
    return sizes


def _hnsw_links(m: int, label: str, part: str) -> int:
    """Bytes per vector of an HNSW graph of degree ``m`` (checked against its bounds)."""
    if not HNSW_DEGREES[0] <= m <= HNSW_DEGREES[1]:
        raise ValueError(f"{label}: {part} has degree M={m}; rag_fast builds HNSW graphs of "
                         f"degree {HNSW_DEGREES[0]} to {HNSW_DEGREES[1]}")
    # 2 * M neighbours on level 0, about M / (M - 1) more above it, and each vector's offsets
    return 4 * (2 * m + 2) + 16


def _parse_factory(spec: str, d: int, label: str) -> FactorySizes:
    """Sizes of a factory string for ``d``-dimensional vectors, parsed in faiss's order."""
    if re.fullmatch(r"(.+),IDMap2?|IDMap2?,(.+)", spec):
        raise ValueError(f"{label}: IDMap adds vectors with ids of the caller's, but rag_fast "
                         "numbers the vectors itself (row i is passage i); drop the IDMap")
    if m := re.fullmatch(r"(.+),RFlat", spec):
        sizes = _parse_factory(m[1], d, label)
        sizes.add("refine vectors (flat)", per_vector=4 * d)
        return sizes
    if m := re.fullmatch(r"(.+),Refine\((.+)\)", spec):
        return _parse_factory(m[1], d, label).merge(_parse_factory(m[2], d, label))
    transforms = FactorySizes(d)
    dim, moved = d, False
    while (m := re.fullmatch(r"([^,]+),(.*)", spec)) and (t := _transform(m[1], dim, label, transforms)):
        dim, spec, moved = t, m[2], True
    if moved:
        sizes = _parse_factory(spec, dim, label)
        sizes.merge(transforms)
        return sizes
    if "(" in spec or ")" in spec:
        raise ValueError(f"{label}: {spec!r}: rag_fast does not size an index given in "
                         f"parentheses; rag_fast sizes {_SIZED}")
    sizes = _code_sizes(spec, d, label, in_ivf=False)
    if sizes is not None:
        return sizes
    if m := re.fullmatch(r"HNSW(\d*)(?:[,_](.*))?", spec):
        hnsw_m = _number(m[1], label) if m[1] else 32
        sizes = _code_sizes(m[2] or "", d, label, in_ivf=False, in_hnsw=True)
        if sizes is None:
            sizes = _unsized(m[2], d, label)
        sizes.add("HNSW graph links", per_vector=_hnsw_links(hnsw_m, label, f"HNSW{m[1]}"))
        return sizes
    coarse, comma, codes = spec.partition(",")
    if m := re.fullmatch(r"IVF(\d+)([kM]?)(?:_HNSW(\d*))?", coarse):
        nlist = _number(m[1], label) * {"": 1, "k": 1024, "M": 1024 * 1024}[m[2]]
        if not 1 <= nlist <= MAX_LISTS:
            raise ValueError(f"{label} has {nlist} inverted lists; rag_fast builds 1 to "
                             f"{MAX_LISTS} lists (k-means needs at least one training vector "
                             f"per list and faiss recommends {KMEANS_POINTS_PER_CENTROID}, so "
                             f"{MAX_LISTS} lists are for corpora of "
                             f"{KMEANS_POINTS_PER_CENTROID * MAX_LISTS} vectors and more)")
        if not comma:
            raise ValueError(f"{label}: an IVF needs its codes after a comma, e.g. "
                             f"'{coarse},Flat', '{coarse},SQ8' or '{coarse},PQ8'")
        sizes = _code_sizes(codes, d, label, in_ivf=True, nlist=nlist)
        if sizes is None:
            sizes = _unsized(codes, d, label, in_ivf=True)
        sizes.nlist, sizes.trains = nlist, True
        sizes.needs.append((nlist, f"has {nlist} inverted lists",
                            lambda t: f"use at most {t} lists (IVF{t})"))
        sizes.construct += nlist * _LIST_BYTES
        sizes.add("inverted lists (empty)", fixed=nlist * _LIST_BYTES)
        sizes.add("coarse centroids", fixed=nlist * d * 4)
        if m[3] is not None:
            hnsw_m = _number(m[3], label) if m[3] else 32
            links = _hnsw_links(hnsw_m, label, f"the coarse quantiser HNSW{m[3]}")
            sizes.add("coarse HNSW graph links", fixed=nlist * links)
        return sizes
    return _unsized(coarse if comma and re.search(r"\d", coarse) else spec, d, label)


def _transform(part: str, d: int, label: str, sizes: FactorySizes) -> int | None:
    """The output dimension of a faiss vector transform ``part`` over ``d`` dimensions, its
    sizes added to ``sizes``; None when ``part`` is no transform rag_fast sizes."""
    if re.fullmatch(r"L2[nN]orm", part):
        return d
    if m := re.fullmatch(r"PCA(W?)(R?)(\d+)", part):
        d_out = _number(m[3], label)
        if not 1 <= d_out <= d:
            raise ValueError(f"{label}: {part} outputs {d_out} dimensions; a PCA outputs 1 to "
                             f"d={d} (the dimension of its input)")
        sizes.trains = True
        sizes.add("transform matrices", fixed=(2 * d * d + d_out * d) * 4)
        return d_out
    if m := re.fullmatch(r"OPQ(\d+)(?:_(\d+))?", part):
        opq_m = _number(m[1], label)
        d_out = _number(m[2], label) if m[2] else d
        if d_out < 1 or opq_m < 1 or d_out % opq_m:
            raise ValueError(f"{label}: {part} has M={opq_m} sub-quantisers, which must divide "
                             f"its output dimension {d_out}")
        sizes.trains = True
        opq_needs = f"{part} trains an 8-bit PQ ({_OPQ_CENTROIDS} centroids per sub-quantiser)"
        sizes.needs.append((_OPQ_CENTROIDS, opq_needs, lambda t: "drop the OPQ"))
        sizes.add("transform matrices", fixed=(max(d, d_out) ** 2 + d_out * _OPQ_CENTROIDS) * 4)
        sizes.add("transform training", per_train=2 * d_out * 4)
        return d_out
    if m := re.fullmatch(r"RR(\d+)?", part):
        d_out = _number(m[1], label) if m[1] else d
        if d_out < 1:
            raise ValueError(f"{label}: {part} outputs no dimensions")
        sizes.trains = True
        sizes.add("transform matrices", fixed=2 * max(d, d_out) ** 2 * 4)
        return d_out
    if m := re.fullmatch(r"Pad(\d+)", part):
        d_out = max(_number(m[1], label), d)
        sizes.construct += d_out * 4
        sizes.add("transform matrices", fixed=d_out * 4)
        return d_out
    return None


def _label(preset: str, factory: str) -> str:
    return f"preset {preset!r}" if preset == factory else f"preset {preset!r} (faiss factory {factory!r})"


def factory_sizes(preset: str, factory: str, d: int, n: int | None = None) -> FactorySizes:
    """Read a faiss factory string (``factory``, given as ``preset``) for ``d``-dimensional
    vectors and check every size in it, before faiss allocates anything: inverted lists (1 to
    :data:`MAX_LISTS`), PQ sub-quantisers (``M`` divides the dimension, 1 to 16 bits), HNSW
    degrees (2 to 1024), fast-scan blocks, OPQ and PCA output dimensions, scalar quantiser
    types, and that what faiss allocates while parsing it fits in the memory available.

    Raises:
        ValueError: naming ``preset``, the part, its value and the bound (and the corpus size
            ``n`` when given).
    """
    label = _label(preset, factory)
    try:
        if not 1 <= d <= _FAISS_INT:
            raise ValueError(f"{label}: the vectors have dimension d={d}; expected 1 to {_FAISS_INT}")
        for digits in re.findall(r"\d+", factory):
            _number(digits, label)
        sizes = _parse_factory(factory, d, label)
    except ValueError as exc:
        if n is None:
            raise
        raise ValueError(f"{exc} (the corpus: {n} vectors of d={d})") from None
    _check_memory(label, {"empty index (allocated when faiss parses the string)": sizes.construct},
                  "to parse it")
    return sizes


def _check_memory(label: str, parts: dict[str, int], what: str) -> None:
    found = available_memory()
    total = sum(parts.values())
    if found is None or total <= found[0]:
        return
    listed = ", ".join(f"{part} {_bytes(v)}" for part, v in sorted(parts.items(), key=lambda kv: -kv[1])
                       if v >= total / 100)
    raise ValueError(f"{label} needs about {_bytes(total)} of memory {what} ({listed}), more than "
                     f"the {_bytes(found[0])} available ({found[1]}); use fewer lists, fewer bits, "
                     "a smaller factory or preset 'exact' on a machine with more memory")


def default_train_points(sizes: FactorySizes, n: int, train_size: int | None = None) -> int:
    """Training vectors :meth:`DenseIndex.build` samples: ``train_size``, else enough for
    k-means (39 per list, at least 2**16, at most 2**17, but never fewer than the factory's
    centroids), at most ``n``."""
    if train_size is not None:
        return min(n, train_size)
    need = max(KMEANS_POINTS_PER_CENTROID * (sizes.nlist or 256), 2**16)
    return min(n, max(min(need, 2**17), sizes.train_min))


def check_corpus(preset: str, factory: str, sizes: FactorySizes, n: int, d: int,
                 train: int | None = None, batch_size: int = 65536, *,
                 reads_a_copy: bool = True) -> None:
    """Check a sized factory (:func:`factory_sizes`) against a corpus of ``n`` vectors of
    ``d``, trained on ``train`` of them (default: :func:`default_train_points`): every
    k-means needs at least one training vector per centroid (an IVF's lists, a PQ's
    ``2**bits`` centroids, OPQ's 256), and the estimated memory of the build (the index, the
    fp16 vectors beside it, the training sample and an add batch) must fit in the memory
    available. ``reads_a_copy``: a sample of a quarter or more of the corpus is read through
    a float32 copy of all of it (False where the embeddings are float32 in RAM already).

    Raises:
        ValueError: naming ``preset``, the value, the bound and the corpus size.
    """
    label = _label(preset, factory)
    train = default_train_points(sizes, n) if train is None else min(train, n)
    if sizes.trains:
        for count, what, instead in sorted(sizes.needs, key=lambda need: -need[0]):
            if count > train:
                have = (f"the corpus has {n} vectors" if train == n
                        else f"it trains on train_size={train} of the corpus's {n} vectors")
                raise ValueError(
                    f"{label} {what} but {have} (k-means needs at least one training vector per "
                    f"centroid, and faiss recommends {KMEANS_POINTS_PER_CENTROID}: "
                    f"{KMEANS_POINTS_PER_CENTROID * count}); {instead(train)}, or preset 'exact'")
    parts = sizes.estimate(n, train if sizes.trains else 0)
    parts["fp16 vectors"] = n * d * 2
    if sizes.trains:
        # the sample as float32 (read through a full float32 copy when it is a quarter or more)
        parts["training sample"] = train * d * 4 + (n * d * 4 if reads_a_copy and train >= n // 4 else 0)
    parts["add batch"] = min(n, batch_size) * d * 4
    _check_memory(label, parts, f"for {n} vectors of d={d}")


def _factory_index(preset: str, factory: str, d: int, n: int | None = None,
                   train: int | None = None):
    """The empty faiss index of ``factory`` (inner product), sized first (:func:`factory_sizes`,
    and with ``n`` :func:`check_corpus`) so that faiss allocates nothing unchecked."""
    sizes = factory_sizes(preset, factory, d, n)
    if n is not None:
        check_corpus(preset, factory, sizes, n, d, train)
    return _new_index(preset, factory, d)


def _new_index(preset: str, factory: str, d: int):
    """faiss's index of a factory string already sized (see :func:`_factory_index`)."""
    try:
        return faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        # faiss says where in its sources it failed ("Error in ... at .../index_factory.cpp:N:
        # could not parse index string X"): only the reason after the location is the user's
        reason = str(exc).strip().splitlines()[-1]
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", reason)
        raise ValueError(f"preset {preset!r} is not a preset {PRESETS} nor a valid faiss "
                         f"factory string: {reason}") from None


def plan_factory(preset: str, n: int, d: int, on_disk: bool = False) -> str:
    """The faiss factory string :meth:`DenseIndex.build` will use for ``n`` vectors of ``d``,
    checked before anything is encoded (``rag-fast index build`` calls it first).

    A factory string is sized before faiss allocates any of it (:func:`factory_sizes`,
    :func:`check_corpus`): its inverted lists, PQ, HNSW and transform sizes against their
    bounds and the corpus, and the build's estimated memory against the memory available.

    Raises:
        ValueError: an unknown preset or factory string, a size out of its bounds, a factory
            whose quantisers need more training vectors than the corpus has (naming both
            numbers), an estimate above the memory available (naming both), or ``on_disk``
            with a preset or factory whose inverted lists faiss cannot memory-map.
    """
    if _check_on_disk(on_disk) and preset in ("exact", "hnsw"):
        raise _on_disk_error(preset, "it has no inverted lists (only an IVF index has)")
    if preset in PRESETS:
        factory = preset_factory(preset, n, d, on_disk)[0]
        check_corpus(preset, factory, factory_sizes(preset, factory, d), n, d)
        return factory
    index = _factory_index(preset, preset, d, n=n)
    if on_disk and (reason := lists_mappable(index)) is not None:
        raise _on_disk_error(preset, reason)
    return preset


_MAX_SETTING = 2**31 - 1  # faiss takes nprobe, efSearch and k as C ints
SETTINGS = ("nprobe", "ef_search", "rerank")  # the search settings of params / search() / tune()
_MANIFEST_KEYS = ("kind", "format", "preset", "factory", "count", "dim", "metric", "params",
                  "faiss_version", "meta", "files")
_OPTIONAL_KEYS = ("on_disk",)  # absent from manifests written before it existed (= False)


def _check_int(name: str, value: object, low: int = 1, high: int = _MAX_SETTING) -> int:
    """``value`` as an int in ``[low, high]``.

    Raises:
        ValueError: naming ``name``, for a non-int (bools included) or an out-of-range value.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ValueError(f"{name} must be an int >= {low}" + (f" and <= {high}" if high < _MAX_SETTING
                                                             else "") + f", got {value!r}")
    return int(value)


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
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_SETTING:
            raise bad(f"params.{key}", f"an int >= 1 and <= {_MAX_SETTING}")
    if set(manifest["files"]) != {_INDEX_FILE, _VECTORS_FILE}:
        raise StorageError(f"{where}: key 'files' lists {sorted(manifest['files'])}, expected "
                           f"{sorted([_INDEX_FILE, _VECTORS_FILE])}")


def _rows(embeddings, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of an array, tensor or list of shards, as float32 numpy."""
    if isinstance(embeddings, (list, tuple)):
        parts, offset = [], 0
        for shard in embeddings:
            lo, hi = max(start - offset, 0), min(stop - offset, len(shard))
            if lo < hi:
                parts.append(_rows(shard, lo, hi))
            offset += len(shard)
        return np.concatenate(parts) if len(parts) != 1 else parts[0]
    chunk = embeddings[start:stop]
    if isinstance(chunk, torch.Tensor):
        chunk = chunk.detach().to("cpu", torch.float32).numpy()
    return np.ascontiguousarray(chunk, dtype=np.float32)


def _reads_a_copy(embeddings) -> bool:
    """Whether :func:`_rows` of all the rows copies them (not float32 C-contiguous in RAM)."""
    if isinstance(embeddings, (list, tuple)):
        return len(embeddings) != 1 or _reads_a_copy(embeddings[0])
    if isinstance(embeddings, torch.Tensor):
        return (embeddings.dtype != torch.float32 or embeddings.device.type != "cpu"
                or not embeddings.is_contiguous())
    return not (isinstance(embeddings, np.ndarray) and not isinstance(embeddings, np.memmap)
                and embeddings.dtype == np.float32 and embeddings.flags.c_contiguous)


def _shape(embeddings) -> tuple[int, int]:
    if isinstance(embeddings, (list, tuple)):
        if not embeddings:
            raise ValueError("embeddings: the corpus is empty (an empty list of shards)")
        shapes = [_shape(s) for s in embeddings]
        if len({d for _, d in shapes}) != 1:
            raise ValueError(f"embeddings shards must share one dimension, got {[d for _, d in shapes]}")
        return sum(n for n, _ in shapes), shapes[0][1]
    shape = tuple(getattr(embeddings, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"embeddings must have shape [N, d], got {shape}")
    return int(shape[0]), int(shape[1])


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
        self._ivf = _extract_ivf(base)
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
        n, d = _shape(embeddings)
        if n == 0:
            raise ValueError(f"embeddings: the corpus is empty (shape [{n}, {d}]); expected N >= 1 rows")
        if d == 0:
            raise ValueError(f"embeddings: shape [{n}, {d}] has no dimensions; expected d >= 1")
        batch_size = _check_int("batch_size", batch_size)
        if queries is not None and (len(getattr(queries, "shape", ())) != 2 or queries.shape[1] != d
                                    or queries.shape[0] == 0):
            raise ValueError(f"queries must have shape [Q >= 1, d={d}] (the embeddings' dimension), "
                             f"got {tuple(getattr(queries, 'shape', ()))}")
        if _check_on_disk(on_disk) and preset in ("exact", "hnsw"):
            raise _on_disk_error(preset, "it has no inverted lists (only an IVF index has)")
        if preset in PRESETS:
            factory, default_rerank = preset_factory(preset, n, d, on_disk)
        else:
            factory, default_rerank = preset, 1
        # every size in the factory string, checked against the corpus and the memory
        # available before faiss allocates any of it
        sizes = factory_sizes(preset, factory, d, n)
        train = default_train_points(sizes, n, None if train_size is None else
                                     _check_int("train_size", train_size))
        check_corpus(preset, factory, sizes, n, d, train, batch_size,
                     reads_a_copy=_reads_a_copy(embeddings))
        base = _new_index(preset, factory, d)
        small = preset in PRESETS and factory == "Flat"  # ivfpq on a small corpus: exact, no lists
        if on_disk and not small and (reason := lists_mappable(base)) is not None:
            raise _on_disk_error(preset, reason)
        on_disk = on_disk and not small
        rerank = default_rerank if rerank is None else _check_int("rerank", rerank, 0)
        params = {"rerank": max(1, rerank)}
        ivf = _extract_ivf(base)
        if ivf is not None:
            params["nprobe"] = _check_int("nprobe", nprobe) if nprobe is not None else max(1, ivf.nlist // 64)
        if isinstance(base, faiss.IndexHNSW):
            params["ef_search"] = _check_int("ef_search", ef_search) if ef_search is not None else 64

        vectors = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        if not base.is_trained:
            size = train
            rng = np.random.default_rng(seed)
            rows = np.sort(rng.choice(n, size=size, replace=False))
            sample = np.concatenate([_rows(embeddings, int(r), int(r) + 1) for r in rows]) \
                if size < n // 4 else _rows(embeddings, 0, n)[rows]
            _check_finite("embeddings", sample)
            if progress:
                tqdm.write(f"training {factory} on {size} vectors")
            base.train(sample)
        for start in tqdm(range(0, n, batch_size), desc=f"adding ({factory})", unit=" batch",
                          disable=not progress):
            chunk = _rows(embeddings, start, min(start + batch_size, n))
            _check_finite("embeddings", chunk, offset=start)
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
        k = _check_int("k", k)
        q, exclude = self._tuning_queries(queries, k, n_queries, seed)
        source = query_source or ("given" if exclude is None else "corpus (leave-one-out)")
        approximate = self.factory != "Flat"
        if approximate and exclude is None:
            self._warn_small_sample(len(q), target_recall)
        if tune and approximate:
            if progress:
                tqdm.write(f"tuning search settings: recall@{k} and same top 5 >= {target_recall} "
                           f"against exact search on {len(q)} queries ({source})")
            self.tune(target_recall, queries=q, k=k, seed=seed, _exclude=exclude, _warned=True)
        per_query = self._quality(q, self._truth(q, k, exclude), exclude)[:2] if approximate else None
        recall, same = (float(v.mean()) for v in per_query) if per_query else (1.0, 1.0)
        reached = _reaches(per_query, target_recall) if per_query else True
        timed = q[:256]  # a batch, as the tuning timed it
        ms = _time_ms(lambda: self.search(timed, min(k, self.ntotal))) / max(1, len(timed))
        quality = {
            "target_recall": float(target_recall), "k": int(min(k, self.ntotal)), "queries": int(len(q)),
            "query_source": source, "recall": round(float(recall), 4), "same_top5": round(float(same), 4),
            "ms_per_query": round(float(ms), 4) if math.isfinite(ms) else None,
            "reached": bool(reached),
            "settings": {key: int(v) for key, v in self.params.items()},
        }
        self.meta = {**(self.meta or {}), "search_quality": quality}
        if not quality["reached"]:
            _warn_once(f"target-{id(self)}", f"no search setting of this {self.factory} index "
                       f"reaches recall@{k} and same top 5 of {target_recall} against exact search "
                       f"(best {quality['recall']}, {quality['same_top5']} at {quality['settings']}); "
                       "consider preset 'exact', another preset or factory, or a lower target")
        return quality

    @staticmethod
    def _warn_small_sample(count: int, target: float) -> None:
        message = small_sample_message(count, target)
        if message is not None:
            warnings.warn(message, SmallSampleWarning, stacklevel=3)

    def _tuning_queries(self, queries, k: int, n_queries: int, seed: int):
        """(queries ``[Q, d]`` float32, the stored row each one is or None): the given queries,
        or a seeded sample of stored vectors for a leave-one-out measurement."""
        if queries is None:
            n_queries = _check_int("n_queries", n_queries)
            rows = np.sort(np.random.default_rng(seed).choice(
                self.ntotal, min(n_queries, self.ntotal), replace=False))
            return self.embeddings[rows].astype(np.float32), rows
        q = self._validate(queries, min(k, self.ntotal))
        q = np.ascontiguousarray(q.cpu().numpy() if isinstance(q, torch.Tensor) else q, dtype=np.float32)
        if len(q) == 0:
            raise ValueError("queries must hold at least one row")
        _check_finite("queries", q)
        return q, None

    def _truth(self, q: np.ndarray, k: int, exclude: np.ndarray | None) -> np.ndarray | None:
        """Exact top ids for :meth:`_quality` (``k + 1`` when leaving each query's own row out);
        None when there is nothing to find (a one-vector corpus searched leave-one-out)."""
        k = min(k, self.ntotal - (exclude is not None))
        return exact_search(self.embeddings, torch.from_numpy(q), k + (exclude is not None))[1].numpy() \
            if k >= 1 else None

    def _quality(self, q: np.ndarray, truth: np.ndarray | None, exclude: np.ndarray | None,
                 **settings) -> tuple[np.ndarray, np.ndarray, float]:
        """Per query: recall@k and whether the top 5 are exact search's top 5, of :meth:`search`
        with ``settings`` against ``truth`` (:meth:`_truth`), and that search's milliseconds per
        query (without the scoring around it); leave-one-out when ``exclude`` names each
        query's own row."""
        if truth is None:
            return np.ones(len(q)), np.ones(len(q)), 0.0
        start = time.perf_counter()
        found = self.search(q, truth.shape[1], **settings)[1]
        ms = (time.perf_counter() - start) * 1e3 / len(q)
        if exclude is not None:
            k = truth.shape[1] - 1
            truth, found = _leave_out(truth, exclude, k), _leave_out(found, exclude, k)
        top = min(5, truth.shape[1])
        recall = np.array([len(set(f[f >= 0].tolist()) & set(t.tolist())) / len(t) for f, t in zip(found, truth)])
        same = np.array([set(f[:top].tolist()) == set(t[:top].tolist()) for f, t in zip(found, truth)], float)
        return recall, same, ms

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
        k = _check_int("k", k, 1, max(1, self.ntotal))
        nprobe = self._setting("nprobe", nprobe, self._ivf is not None)
        ef = self._setting("ef_search", ef_search, self._hnsw)
        if self._refine is None:
            if rerank is not None and _check_int("rerank", rerank) > 1:
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
            return _check_int(name, value)
        value = self.params.get(name)
        if value is None:
            if used:
                raise ValueError(f"{name}: this index has no default {name} (params={self.params}); "
                                 f"pass {name}=...")
            return None
        return _check_int(f"params[{name!r}]", value)

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

    def _validate(self, queries, k) -> np.ndarray:
        if isinstance(queries, torch.Tensor):
            if not queries.is_floating_point():
                raise ValueError(f"queries must be a floating tensor, got dtype {queries.dtype}")
            q = queries.detach()
        elif isinstance(queries, np.ndarray):
            if not np.issubdtype(queries.dtype, np.floating):
                raise ValueError(f"queries must be a floating array, got dtype {queries.dtype}")
            q = queries
        else:
            raise ValueError(f"queries must be a numpy array or torch tensor [B, d], got {type(queries).__name__}")
        if q.ndim != 2:
            raise ValueError(f"queries must have shape [B, d={self.dim}], got {tuple(q.shape)}")
        if q.shape[1] != self.dim:
            raise ValueError(f"queries must have d={self.dim} columns (the index dimension), got {q.shape[1]}")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        if k > self.ntotal:
            raise ValueError(f"k={k} must be <= the number of indexed vectors ({self.ntotal})")
        return q

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
        q = self._validate(queries, k)
        is_torch = isinstance(q, torch.Tensor)
        if self._gpu is not None and is_torch and q.is_cuda:
            return self._search_gpu(q, k, nprobe, ef_search, rerank)
        q_np = q.to("cpu", torch.float32).numpy() if is_torch else q
        q_np = np.ascontiguousarray(q_np, dtype=np.float32)
        _check_finite("queries", q_np)
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
            if rerank is not None and _check_int("rerank", rerank) > 1:
                raise ValueError("rerank: this index was built without re-ranking (rerank=1)")
            scores, ids = _search_tensor(gpu_index, q, k, params)
            scores = torch.where(ids < 0, torch.full_like(scores, -math.inf), scores)
            return scores, ids
        # the CPU's IndexRefine: rerank * max(k, 10) candidates, re-scored exactly on the fp16 vectors
        n_cand = min(self._rerank_candidates(k, self._setting("rerank", rerank, True)), GPU_MAX_K)
        _, cand = _search_tensor(gpu_index, q, n_cand, params)  # [B, n_cand]
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
        _exclude: np.ndarray | None = None,
        _warned: bool = False,
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
        if (isinstance(target_recall, bool) or not isinstance(target_recall, numbers.Real)
                or not 0.0 < float(target_recall) <= 1.0):
            raise ValueError(f"target_recall must be a number in (0, 1], got {target_recall!r}")
        k = _check_int("k", k, 1, max(1, self.ntotal))
        n_queries = _check_int("n_queries", n_queries)
        if isinstance(rerank_factors, (str, bytes)) or not isinstance(rerank_factors, Sequence):
            raise ValueError(f"rerank_factors must be a sequence of ints >= 1, got {rerank_factors!r}")
        rerank_factors = [_check_int(f"rerank_factors[{i}]", f, 0) for i, f in enumerate(rerank_factors)]
        if self._refine is not None and not any(f >= 1 for f in rerank_factors):
            raise ValueError(f"rerank_factors must hold at least one int >= 1, got {rerank_factors!r}")
        if _exclude is None:
            q, _exclude = self._tuning_queries(queries, k, n_queries, seed)
        else:
            q = queries
        if queries is not None and _exclude is None and not _warned and (self._ivf is not None
                                                                          or self._hnsw):
            self._warn_small_sample(len(q), target_recall)
        if self._ivf is not None:
            knob, grid = "nprobe", [2**i for i in range(int(math.log2(self._ivf.nlist)) + 1)]
        elif self._hnsw:
            knob, grid = "ef_search", [max(k, 2**i) for i in range(4, 12)]
        else:
            recall, same, _ = self._quality(q, self._truth(q, k, _exclude), _exclude)
            recall, same = float(recall.mean()), float(same.mean())
            return {"recall": recall, "same_top5": same, "reached": True,
                    "ms_per_query": _time_ms(lambda: self.search(q, k)) / len(q)}
        # largest re-rank first: it reaches the target at the smallest nprobe / ef_search, and
        # its time then bounds the search of the others (a setting already slower than the
        # best found stops its factor's sweep: larger values only cost more)
        factors = sorted({f for f in rerank_factors if f >= 1}, reverse=True) if self._refine is not None else [None]
        truth = self._truth(q, k, _exclude)
        best, fallback = None, None
        for factor in factors:
            for value in grid:
                kw = {knob: value, "rerank": factor}
                *per_query, search_ms = self._quality(q, truth, _exclude, **kw)
                rec, same = (float(v.mean()) for v in per_query)
                if best is not None and search_ms > 1.5 * best["ms_per_query"]:
                    break
                if fallback is None or min(rec, same) > min(fallback["recall"], fallback["same_top5"]):
                    fallback = {**kw, "recall": rec, "same_top5": same, "reached": False,
                                "ms_per_query": math.nan}
                if _reaches(per_query, target_recall):
                    ms = _time_ms(lambda: self.search(q[:256], k, **kw)) / len(q[:256])
                    if best is None or ms < best["ms_per_query"]:
                        best = {**kw, "recall": rec, "same_top5": same, "reached": True, "ms_per_query": ms}
                    break
        choice = best or fallback
        self.params[knob] = choice[knob]
        if choice.get("rerank") is not None:
            self.params["rerank"] = choice["rerank"]
        return {key: v for key, v in choice.items() if v is not None}

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
                    _write_faiss(self._base, tmp / _INDEX_FILE, shown / _INDEX_FILE)
                _write_faiss(self._vectors, tmp / _VECTORS_FILE, shown / _VECTORS_FILE)
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
                    _write_all(out.fileno(), chunk)
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


def _write_faiss(index, dest: Path, shown: Path) -> None:
    """``faiss.write_index`` of ``index`` to ``dest`` (the file ``shown`` in messages), its
    errors as ``OSError``: a full disk (faiss's ``RuntimeError`` ending in "No space left on
    device") is one :class:`~rag_fast.retrieval.NoSpaceError` naming the file, the
    bytes it needs (counted then, by a second serialisation that writes nothing) and the
    bytes free. The bytes go through our own writes, not faiss's file: faiss prints a
    "close error" line of its own on stderr when the disk fills under its file."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        faiss.write_index(index, faiss.PyCallbackIOWriter(lambda chunk: _write_all(fd, chunk)))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpaceError(shown, _serialized_bytes(index), disk_free(dest),
                               exc.errno) from None
        raise
    except RuntimeError as exc:
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", str(exc).strip().splitlines()[-1])
        for code in (errno.ENOSPC, errno.EDQUOT):
            if os.strerror(code) in reason:
                raise NoSpaceError(shown, _serialized_bytes(index), disk_free(dest), code) from None
        raise OSError(f"faiss could not write {shown}: {reason}") from None
    finally:
        os.close(fd)


def _serialized_bytes(index) -> int:
    """Bytes of ``faiss.write_index(index)``, counted without keeping them."""
    size = 0

    def count(chunk: bytes) -> None:
        nonlocal size
        size += len(chunk)

    faiss.write_index(index, faiss.PyCallbackIOWriter(count))
    return size


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of ``|found_i ∩ truth_i| / k`` (``[Q, k]`` int ids each)."""
    found, truth = np.asarray(found), np.asarray(truth)
    hits = sum(len(set(f[f >= 0].tolist()) & set(t.tolist())) for f, t in zip(found, truth))
    return hits / truth.size


def _reaches(per_query: tuple[np.ndarray, ...], target: float) -> bool:
    """Whether each per-query measure's mean reaches ``target`` with 95% confidence: its
    one-sided lower bound, mean - 1.645 * std / sqrt(n), is >= ``target`` (so a setting that
    only just passes on this sample of queries is not chosen over one that surely does).

    This normal approximation says nothing on a small sample whose queries all match exact
    search (its std is 0, its bound the mean, 1): :func:`min_tuning_queries` is the sample
    below which that 95% cannot hold, and :meth:`DenseIndex.tune` warns below it."""
    return all(v.mean() - 1.645 * v.std() / math.sqrt(len(v)) >= target for v in per_query)


TUNING_CONFIDENCE = 0.95  # the confidence _reaches asks of a setting


class SmallSampleWarning(UserWarning):
    """Too few tuning queries to show the target at the tuner's confidence (see
    :func:`min_tuning_queries`)."""


def min_tuning_queries(target: float, confidence: float = TUNING_CONFIDENCE) -> int | None:
    """The fewest queries on which search quality ``target`` can be shown with ``confidence``:
    the smallest Q whose exact one-sided (Clopper-Pearson) lower bound with all Q queries
    matching exact search, ``(1 - confidence) ** (1 / Q)``, reaches ``target``. With fewer,
    not even a perfect result shows the target (27 queries: 0.895 at most, short of 0.95,
    which needs 59). None for ``target`` 1, which no finite sample shows."""
    if not 0.0 < target <= 1.0 or not 0.0 < confidence < 1.0:
        raise ValueError(f"target must be in (0, 1] and confidence in (0, 1), got {target!r}, "
                         f"{confidence!r}")
    if target >= 1.0:
        return None
    alpha = 1.0 - confidence
    q = max(1, math.ceil(math.log(alpha) / math.log(target)))
    while alpha ** (1.0 / q) < target:  # the float log ratio may land one off either way
        q += 1
    while q > 1 and alpha ** (1.0 / (q - 1)) >= target:
        q -= 1
    return q


def small_sample_message(count: int, target: float, name: str = "queries") -> str | None:
    """One line when ``count`` tuning queries are fewer than :func:`min_tuning_queries`
    needs for ``target`` (naming ``name``: the argument or flag that gave them), else None."""
    need = min_tuning_queries(float(target))
    if need is None or count >= need:
        return None
    bound = (1.0 - TUNING_CONFIDENCE) ** (1.0 / max(1, count))
    return (f"{name}: {count} queries are too few to show recall and same top 5 >= {target} "
            f"with {TUNING_CONFIDENCE:.0%} confidence (even if all {count} matched exact search, "
            f"the exact one-sided lower bound would be {bound:.3f}); give at least {need} "
            "queries for this target, or the tuned settings may fall short of it on new ones")


def _search_tensor(index, q: torch.Tensor, k: int, params) -> tuple[torch.Tensor, torch.Tensor]:
    """faiss ``search`` on a contiguous float32 tensor, results as tensors on its device.

    The raw ``search_c`` with the tensors' pointers (faiss GPU reads and writes device memory
    in place): ``faiss.contrib.torch_utils`` would do the same but replaces ``search`` on
    every faiss class, process-wide, with a version that takes no ``params``.
    """
    n = q.shape[0]
    scores = torch.empty((n, k), dtype=torch.float32, device=q.device)
    ids = torch.empty((n, k), dtype=torch.int64, device=q.device)
    if q.is_cuda:  # faiss runs on its own stream: q must be ready, and the results before use
        torch.cuda.synchronize(q.device)
    index.search_c(n, faiss.cast_integer_to_float_ptr(q.data_ptr()), k,
                   faiss.cast_integer_to_float_ptr(scores.data_ptr()),
                   faiss.cast_integer_to_idx_t_ptr(ids.data_ptr()), params)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    return scores, ids


def _leave_out(ids: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """``[Q, k]``: each row of ``ids`` ``[Q, k + 1]`` without the query's own id ``own[i]``
    (or without its last entry when the own id is not there)."""
    keep = ids != own[:, None]
    keep[keep.all(1), -1] = False
    return ids[keep].reshape(len(ids), k)


def _time_ms(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


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


def _check_finite(name: str, x: np.ndarray, offset: int = 0) -> None:
    # The sum is NaN or inf when any entry is (or on overflow): a cheap test, then locate.
    if not np.isfinite(x.sum(dtype=np.float64)) and not np.isfinite(x).all():
        row = int(np.argwhere(~np.isfinite(x))[0][0]) + offset
        raise ValueError(f"{name} contain NaN or inf (row {row})")


def _mark_missing(scores: np.ndarray, ids: np.ndarray) -> None:
    missing = ids < 0
    if missing.any():
        scores[missing] = -np.inf
