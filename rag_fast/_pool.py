"""Reused memory for the large CPU outputs of rag_fast's ops: the logits' gradient of both
losses, the RAG-Token marginal and its gradient, and the LM head's weight gradient in
``RagModel`` training.

Why: torch's CPU allocator hands a large buffer back to the operating system when it is freed
(glibc unmaps blocks above its mmap threshold), so the next call of the same size gets fresh
pages, which the kernel zeroes and maps one page fault at a time: for a logits' gradient of
a hundred MiB and more, a large share of the op's time (measured in docs/design.md, "The CPU
buffer pool").

How: a buffer of at least :data:`MIN_BYTES` is a private anonymous memory map (2 MiB aligned,
transparent huge pages requested) of which the tensor holds a slice (a ``memoryview``, the
"lease", wrapped by ``torch.frombuffer``). When the tensor and every view of it are gone, the
lease dies and the map is idle; the next request of a size that fits (a map at most twice its
size) takes it, already resident. While a lease lives, its map cannot be closed (the lease
holds a buffer export of it), so memory in use is never released or handed out twice.

Idle memory is bounded by ``RAG_FAST_POOL_MB`` (default 2048 MiB; 0 turns the pool off): a
request larger than that is not pooled, and whenever a lease dies the idle maps beyond the
limit are released, the longest idle first. :func:`empty_cache` releases every idle map now;
:func:`pool_info` reports what the pool holds. The memory of an idle map stays in the process's
resident set until then, as with torch's CUDA caching allocator; a memory measurement should
call :func:`empty_cache` first (``benchmarks/harness.py`` does).

Only CPU tensors are pooled, never while ``torch.compile`` traces (the compiler plans its
buffers itself); a pooled tensor behaves like any other except that its storage cannot grow
(``resize_`` to a larger size raises). The maps are private: after ``fork()`` a child's writes
never reach the parent's memory, as with ordinary torch memory.
"""
from __future__ import annotations

import mmap
import os
import re
import threading
import weakref

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
    if not re.fullmatch(r"[0-9]+", raw.strip()):
        raise ValueError(f"{ENV} must be a whole number of MiB >= 0 (0 turns the pool off), "
                         f"got {raw!r}")
    mb = int(raw.strip())
    return mb << 20


class _Block:
    __slots__ = ("map", "size", "offset", "lease", "reserved", "freed_at")

    def __init__(self, nbytes: int) -> None:
        self.size = -(-nbytes // _ALIGN) * _ALIGN
        # private: after fork() a child's writes stay its own (a shared map would not)
        self.map = mmap.mmap(-1, self.size + _ALIGN, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # a hint: Linux only, failure ignored
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # pragma: no cover - kernels without transparent huge pages
                pass
        with memoryview(self.map) as whole:
            address = torch.frombuffer(whole, dtype=torch.uint8, count=1).data_ptr()
        self.offset = (-address) % _ALIGN
        self.lease = None  # weakref to the memoryview a tensor holds
        self.reserved = False  # chosen for a request that is being served
        self.freed_at = 0

    def idle(self) -> bool:
        return not self.reserved and (self.lease is None or self.lease() is None)

    def release(self) -> bool:
        """Unmap; False if something still holds an export of the map."""
        try:
            self.map.close()
        except BufferError:
            return False
        return True


class _Pool:
    def __init__(self) -> None:
        self._blocks: list[_Block] = []
        self._tick = 0
        # reentrant: a lease's finalizer (below) may run inside empty(), e.g. from a garbage
        # collection that an allocation there triggers
        self._lock = threading.RLock()

    def after_fork_in_child(self) -> None:
        self._lock = threading.RLock()  # another thread of the parent may have held it

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        limit = limit_bytes()
        if nbytes < MIN_BYTES or nbytes > limit:
            if limit == 0:
                self.release_idle()
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            fits = [b for b in list(self._blocks) if nbytes <= b.size <= 2 * nbytes and b.idle()]
            block = min(fits, key=lambda b: b.size) if fits else self._new_block(nbytes)
            if block is None:  # the operating system refused a map: torch's own memory
                return torch.empty(shape, dtype=dtype)
            block.reserved = True
            try:
                lease = memoryview(block.map)[block.offset:block.offset + nbytes]
                block.lease = weakref.ref(lease)
                weakref.finalize(lease, self._on_free, block).atexit = False
                tensor = torch.frombuffer(lease, dtype=torch.uint8)
            finally:
                block.reserved = False
        return tensor.view(dtype).view(shape)

    def _new_block(self, nbytes: int) -> _Block | None:
        for attempt in range(2):
            try:
                block = _Block(nbytes)
            except OSError:
                if attempt == 0:
                    self.release_idle()  # room for it, then one more try
                continue
            self._blocks.append(block)
            return block
        return None

    def _on_free(self, block: _Block) -> None:
        """A lease died: its map is idle; release idle maps beyond the limit."""
        try:
            limit = limit_bytes()
        except ValueError:  # reported by the next request; a finalizer cannot raise
            return
        with self._lock:
            self._tick += 1
            block.freed_at = self._tick
            idle = sorted((b for b in list(self._blocks) if b.idle()), key=lambda b: b.freed_at)
            total = sum(b.size for b in idle)
            for b in idle:
                if total <= limit:
                    break
                if b.release():
                    total -= b.size
                    self._blocks.remove(b)

    def release_idle(self) -> int:
        with self._lock:
            released = 0
            for b in list(self._blocks):
                if b.idle() and b.release():
                    self._blocks.remove(b)
                    released += b.size
            return released

    def info(self) -> dict[str, int]:
        with self._lock:
            idle = sum(b.size for b in self._blocks if b.idle())
            return {"blocks": len(self._blocks), "idle_bytes": idle,
                    "in_use_bytes": sum(b.size for b in self._blocks) - idle,
                    "limit_bytes": limit_bytes()}


# A bad RAG_FAST_POOL_MB is not an import error (a command-line tool could not report it
# without a traceback): RagModel's argument checks and the rag-fast command check it before
# any work, and every pool request raises it.
_POOL = _Pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.after_fork_in_child)


def empty(shape, dtype: torch.dtype, like: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on the CPU, from the pool
    when it is large enough (see the module docstring). With ``like``, a tensor on ``like``'s
    device: CUDA (torch's own caching allocator), fake and meta tensors and tensor subclasses
    get ``like.new_empty`` (their device and subclass), as does anything while
    ``torch.compile`` traces."""
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(n) for n in shape)
    if torch.compiler.is_compiling() or (like is not None and (
            type(like) is not torch.Tensor or like.device.type != "cpu")):
        if like is None:
            return torch.empty(shape, dtype=dtype)
        return like.new_empty(shape, dtype=dtype)  # its device, and its subclass if any
    return _POOL.empty(shape, dtype)


def empty_cache() -> int:
    """Release the pool's idle memory to the operating system; returns the bytes released.
    Buffers still held by a tensor stay where they are."""
    return _POOL.release_idle()


def pool_info() -> dict[str, int]:
    """The CPU buffer pool: ``blocks`` (maps held), ``idle_bytes`` (ready for reuse),
    ``in_use_bytes`` (held by tensors) and ``limit_bytes`` (``RAG_FAST_POOL_MB``)."""
    return _POOL.info()
