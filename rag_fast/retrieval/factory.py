"""faiss factory strings for rag_fast's index: the presets' factories, and any factory string
read with the grammar of faiss's index_factory and sized (lists, PQ, HNSW, transforms) against
its bounds, the corpus and the memory available, before faiss allocates any of it; then the
empty faiss index of a factory so checked.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

from rag_fast._defaults import PRESETS  # ("exact", "hnsw", "ivfpq")
from rag_fast.retrieval.faiss_support import LazyFaiss, lists_mappable
from rag_fast.storage import StorageError

faiss = LazyFaiss(__name__)

SMALL_CORPUS = 39 * 16  # below: every preset is exact search (k-means of 16 lists needs 624)


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


def check_on_disk(on_disk: object) -> bool:
    """``on_disk``, checked to be a bool."""
    if not isinstance(on_disk, bool):
        raise ValueError(f"on_disk must be True or False, got {on_disk!r}")
    return on_disk



def on_disk_error(preset: str, reason: str) -> ValueError:
    """The error of ``on_disk=True`` with a ``preset`` whose lists faiss cannot map (``reason``)."""
    return ValueError(f"on_disk=True: preset {preset!r} cannot keep inverted lists on disk: "
                      f"{reason}; use preset 'ivfpq' (8-bit PQ lists with on_disk) or an IVF "
                      "factory without fast-scan, e.g. 'IVF4096,PQ64' or 'IVF4096,SQ8'")


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
            found = (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                     "free physical memory")
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
    while ((m := re.fullmatch(r"([^,]+),(.*)", spec))
           and (t := _transform(m[1], dim, label, transforms))):
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
    if preset == factory:
        return f"preset {preset!r}"
    return f"preset {preset!r} (faiss factory {factory!r})"


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
            raise ValueError(f"{label}: the vectors have dimension d={d}; "
                             f"expected 1 to {_FAISS_INT}")
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
    listed = ", ".join(f"{part} {_bytes(v)}"
                       for part, v in sorted(parts.items(), key=lambda kv: -kv[1])
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
        copy = n * d * 4 if reads_a_copy and train >= n // 4 else 0
        parts["training sample"] = train * d * 4 + copy
    parts["add batch"] = min(n, batch_size) * d * 4
    _check_memory(label, parts, f"for {n} vectors of d={d}")


def factory_index(preset: str, factory: str, d: int, n: int | None = None,
                   train: int | None = None):
    """The empty faiss index of ``factory`` (inner product), sized first (:func:`factory_sizes`,
    and with ``n`` :func:`check_corpus`) so that faiss allocates nothing unchecked."""
    sizes = factory_sizes(preset, factory, d, n)
    if n is not None:
        check_corpus(preset, factory, sizes, n, d, train)
    return new_index(preset, factory, d)


def new_index(preset: str, factory: str, d: int):
    """faiss's index of a factory string already sized (see :func:`factory_index`).

    faiss's factory turns on polysemous training for an IVF-PQ with 8-bit codes: a reordering of
    each sub-quantizer's centroids so that Hamming distances between codes approximate theirs,
    for polysemous filtering (``polysemous_ht``), which no search here uses. It is turned off:
    the distances every search computes are the same (the centroids are the same, in another
    order), and it was most of the training time (IVF64,PQ32 over 20,000 vectors of 256: 83 s
    with it, 14 s without).
    """
    try:
        index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        # faiss says where in its sources it failed ("Error in ... at .../index_factory.cpp:N:
        # could not parse index string X"): only the reason after the location is the user's
        reason = str(exc).strip().splitlines()[-1]
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", reason)
        raise ValueError(f"preset {preset!r} is not a preset {PRESETS} nor a valid faiss "
                         f"factory string: {reason}") from None
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and hasattr(faiss.downcast_index(ivf), "do_polysemous_training"):
        faiss.downcast_index(ivf).do_polysemous_training = False
    return index


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
    if check_on_disk(on_disk) and preset in ("exact", "hnsw"):
        raise on_disk_error(preset, "it has no inverted lists (only an IVF index has)")
    if preset in PRESETS:
        factory = preset_factory(preset, n, d, on_disk)[0]
        check_corpus(preset, factory, factory_sizes(preset, factory, d), n, d)
        return factory
    index = factory_index(preset, preset, d, n=n)
    if on_disk and (reason := lists_mappable(index)) is not None:
        raise on_disk_error(preset, reason)
    return preset


def check_recorded_factory(manifest_path: Path, index_file: Path, manifest: dict, base) -> None:
    """An index manifest's recorded ``factory`` describes the index faiss read from
    ``index_file``: an inverted file of as many lists (``IVF<n>``) exactly when it is one.

    Raises:
        StorageError: naming the manifest and what the index file holds.
    """
    try:
        ivf = faiss.extract_index_ivf(base)
    except RuntimeError:
        ivf = None
    lists = re.search(r"(?:^|,)IVF(\d+)", manifest["factory"])
    if (ivf.nlist if ivf is not None else None) != (int(lists.group(1)) if lists else None):
        held = f"an inverted file of {ivf.nlist} lists" if ivf is not None else "no inverted file"
        raise StorageError(f"{manifest_path}: key 'factory' is {manifest['factory']!r:.80} but "
                           f"{index_file} holds {held} (an edited manifest, or mixed-up files)")
