"""Reused memory for the large CPU outputs of rag_fast's ops (the logits' gradient of the
losses, the RAG-Token marginal and its gradient).

Why: torch's CPU allocator hands a large buffer back to the operating system when it is freed
(glibc unmaps blocks above its mmap threshold), so the next call of the same size gets fresh
pages, which the kernel zeroes and maps one page fault at a time. For the logits' gradient of
B4 K5 T32 V50265 (128 MiB fp32) that costs more than the kernel that writes it: a RAG-Token
loss's forward + backward measured 31-33 ms with a fresh gradient and 19-20 ms with a reused
one on a 2-core AMD EPYC (docs/benchmarks.md, "Memory pool").

How: a buffer of at least :data:`MIN_BYTES` is an anonymous memory map (2 MiB aligned, huge
pages requested) wrapped by ``torch.frombuffer``; the tensor holds the only other reference to
the map, so once every tensor and view on it is gone the map is idle and the next request of a
size that fits (at most twice its size) takes it, already resident. Idle maps beyond the limit
(``RAG_FAST_POOL_MB``, default 2048 MiB; 0 turns the pool off) are released when the next buffer
is requested, the least recently used first; :func:`empty_cache` releases them all.

The memory of an idle map stays in the process's resident set until then, as with torch's
CUDA caching allocator: :func:`pool_info` says how much, and a memory measurement should call
:func:`empty_cache` first (``benchmarks/bench_losses.py`` does).

Only CPU tensors are pooled, never while ``torch.compile`` traces (the compiler plans its
buffers itself), and a tensor from the pool behaves like any other except that its storage
cannot be resized (``resize_`` to a larger size raises).
"""
from __future__ import annotations

import mmap
import os
import sys
import threading

import torch

MIN_BYTES = 4 << 20  # smaller buffers come from glibc's heap, already reused
DEFAULT_LIMIT_MB = 2048
ENV = "RAG_FAST_POOL_MB"
_ALIGN = 1 << 21  # a huge page: the kernel backs aligned 2 MiB ranges with one page each


def limit_bytes() -> int:
    """Idle bytes the pool may keep: ``RAG_FAST_POOL_MB`` (read at each call), default
    :data:`DEFAULT_LIMIT_MB`. Raises ValueError naming the variable for a value that is not
    an integer >= 0."""
    raw = os.environ.get(ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_LIMIT_MB << 20
    try:
        mb = int(raw.strip())
    except ValueError:
        mb = -1
    if mb < 0:
        raise ValueError(f"{ENV} must be a whole number of MiB >= 0 (0 turns the pool off), "
                         f"got {raw!r}")
    return mb << 20


class _Block:
    __slots__ = ("map", "size", "offset", "last_use")

    def __init__(self, nbytes: int, tick: int) -> None:
        self.size = -(-nbytes // _ALIGN) * _ALIGN
        self.map = mmap.mmap(-1, self.size + _ALIGN)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # a hint: Linux only, failure ignored
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # pragma: no cover - kernels without transparent huge pages
                pass
        address = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
        self.offset = (-address) % _ALIGN
        self.last_use = tick

    def idle(self) -> bool:
        # references: this block's attribute and getrefcount's argument; a tensor on the map
        # (torch.frombuffer) holds one more until its storage is freed
        return sys.getrefcount(self.map) == 2

    def release(self) -> None:
        self.map.close()


class _Pool:
    def __init__(self) -> None:
        self._blocks: list[_Block] = []
        self._tick = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        limit = limit_bytes()
        if nbytes < MIN_BYTES or limit == 0:
            if limit == 0:
                self.release_idle()
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            self._tick += 1
            fits = [b for b in self._blocks if nbytes <= b.size <= 2 * nbytes and b.idle()]
            block = min(fits, key=lambda b: b.size) if fits else None
            if block is None:
                block = _Block(nbytes, self._tick)
                self._blocks.append(block)
            block.last_use = self._tick
            self._trim(limit, keep=block)
            view = torch.frombuffer(block.map, dtype=torch.uint8, count=nbytes,
                                    offset=block.offset)
        return view.view(dtype).view(shape)

    def _trim(self, limit: int, keep: _Block | None = None) -> None:
        idle = sorted((b for b in self._blocks if b is not keep and b.idle()),
                      key=lambda b: b.last_use)
        total = sum(b.size for b in idle)
        for b in idle:
            if total <= limit:
                break
            total -= b.size
            self._blocks.remove(b)
            b.release()

    def release_idle(self) -> int:
        with self._lock:
            idle = [b for b in self._blocks if b.idle()]
            for b in idle:
                self._blocks.remove(b)
                b.release()
            return sum(b.size for b in idle)

    def info(self) -> dict[str, int]:
        with self._lock:
            idle = [b.size for b in self._blocks if b.idle()]
            return {"blocks": len(self._blocks), "idle_bytes": sum(idle),
                    "in_use_bytes": sum(b.size for b in self._blocks) - sum(idle)}


_POOL = _Pool()


def empty(shape, dtype: torch.dtype, like: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on the CPU, from the pool
    when it is large enough (see the module docstring). With ``like``, a tensor on ``like``'s
    device: CUDA (torch's own caching allocator), fake and meta tensors, and anything under
    ``torch.compile`` get ``torch.empty``."""
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(n) for n in shape)
    if like is not None and (type(like) is not torch.Tensor or like.device.type != "cpu"
                             or torch.compiler.is_compiling()):
        return torch.empty(shape, dtype=dtype, device=like.device)
    if torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype)
    return _POOL.empty(shape, dtype)


def empty_cache() -> int:
    """Release the pool's idle memory to the operating system; returns the bytes released.
    Buffers still held by a tensor stay where they are."""
    return _POOL.release_idle()


def pool_info() -> dict[str, int]:
    """``{"blocks", "idle_bytes", "in_use_bytes"}`` of the CPU buffer pool."""
    return _POOL.info()
