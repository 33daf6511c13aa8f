"""faiss itself for rag_fast's index: the ``faiss`` module imported at its first use, what
faiss GPU can hold, the inverted lists inside an index (and whether faiss can memory-map them),
faiss's raw search on torch tensors, and the writer of faiss index files (a full disk named).
"""
from __future__ import annotations

import errno
import importlib
import os
import re
import sys
from pathlib import Path

import torch

from rag_fast.storage import NoSpaceError, disk_free


class LazyFaiss:
    """The ``faiss`` module, imported at its first use. Everything that builds, loads or
    searches an index needs faiss; what only trains or decodes (``rag_fast.models``,
    ``rag_fast.training``) imports this package without it, as on a GPU machine whose image
    has no faiss. The first attribute read replaces this object by the module itself, as the
    global ``faiss`` of the module named ``owner`` (each module that uses faiss holds one)."""

    def __init__(self, owner: str):
        self._owner = owner

    def __getattr__(self, name: str):
        try:
            module = importlib.import_module("faiss")
        except ImportError as e:
            raise ImportError(f"rag_fast's index needs faiss, which does not import ({e}): "
                              "pip install faiss-cpu, or a faiss build for your GPU") from e
        setattr(sys.modules[self._owner], "faiss", module)
        return getattr(module, name)


faiss = LazyFaiss(__name__)


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


def extract_ivf(index):
    """The IVF inside a faiss index, or None when it has none."""
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def lists_mappable(index) -> str | None:
    """None when faiss can memory-map the inverted lists of ``index`` (an IVF whose lists are
    faiss's plain array lists, written contiguously by ``write_index``), else the reason."""
    ivf = extract_ivf(index)
    if ivf is None:
        return "it has no inverted lists (only an IVF index has)"
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    if isinstance(lists, faiss.BlockInvertedLists):
        return "its lists are fast-scan blocks, which faiss always reads into RAM"
    if not isinstance(lists, (faiss.ArrayInvertedLists, faiss.OnDiskInvertedLists)):
        return f"faiss keeps its lists as {type(lists).__name__}, which it cannot memory-map"
    return None


def search_tensor(index, q: torch.Tensor, k: int, params) -> tuple[torch.Tensor, torch.Tensor]:
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


def write_faiss(index, dest: Path, shown: Path) -> None:
    """``faiss.write_index`` of ``index`` to ``dest`` (the file ``shown`` in messages), its
    errors as ``OSError``: a full disk (faiss's ``RuntimeError`` ending in "No space left on
    device") is one :class:`~rag_fast.retrieval.NoSpaceError` naming the file, the
    bytes it needs (counted then, by a second serialisation that writes nothing) and the
    bytes free. The bytes go through our own writes, not faiss's file: faiss prints a
    "close error" line of its own on stderr when the disk fills under its file."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        faiss.write_index(index, faiss.PyCallbackIOWriter(lambda chunk: write_all(fd, chunk)))
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


def write_all(fd: int, data) -> None:
    """Write all of ``data`` to the descriptor ``fd`` (``os.write`` may write part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
