"""Process groups for data-parallel training: one process per device, gloo on CPU, nccl on GPU.

``rag-fast train`` under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR set) joins the group with
:func:`init_from_env`; :func:`spawn` starts ``world_size`` local processes (tests, one machine);
:func:`world` is this process's rank and the group's size.

:func:`broadcast_module` and :func:`average_gradients` do by hand what DDP does when it wraps a
module and after a backward pass, for the Trainer's first step, which decides DDP's
``find_unused_parameters`` from the gradients it gets (see ``rag_fast.training.trainer``).
"""
from __future__ import annotations

import os
import socket
from typing import Callable, Sequence

import torch
import torch.distributed as dist

BUCKET_BYTES = 32 << 20  # most bytes per collective of broadcast_module, average_gradients


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, or ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(device: torch.device | str | None = None, backend: str | None = None) -> bool:
    """Join the process group described by torchrun's variables; False when WORLD_SIZE <= 1.

    The backend follows where this rank trains: nccl for a CUDA ``device`` (made the current
    device), gloo for the CPU; ``device=None`` means CUDA when it is available."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    if backend is None:
        backend = "nccl" if (device.type == "cuda" if device is not None
                             else torch.cuda.is_available()) else "gloo"
    dist.init_process_group(backend)
    if device is None and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return True


def _entry(rank: int, fn: Callable, world_size: int, port: int, backend: str, args: tuple):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in a group.

    ``fn`` must be importable by name (a module-level function)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world_size, free_port(), backend, args), nprocs=world_size,
             join=True)


def _buckets(tensors: Sequence[torch.Tensor]):
    """``tensors`` in groups of one device and dtype, each at most :data:`BUCKET_BYTES` (or
    one tensor), in order within a group."""
    groups: dict[tuple, list] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        bucket, size = [], 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def _collective(tensors: Sequence[torch.Tensor], op: Callable[[torch.Tensor], None]) -> None:
    """Run ``op`` on each bucket of ``tensors`` flattened into one tensor, then copy back."""
    for bucket in _buckets(tensors):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        op(flat)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Give every rank rank ``src``'s parameters and buffers (collective), as wrapping the
    module in DDP does."""
    tensors = [t.detach() for t in (*module.parameters(), *module.buffers())]
    _collective(tensors, lambda flat: dist.broadcast(flat, src))


@torch.no_grad()
def average_gradients(params: Sequence[torch.nn.Parameter]) -> list[int]:
    """Average the gradients of ``params`` over the ranks (collective), as DDP does with
    ``find_unused_parameters=True``: each rank's gradient divided by the world size, then
    summed; a rank where a parameter got no gradient (``grad`` None) adds zeros, and a
    parameter that got none on any rank keeps ``grad`` None.

    Returns:
        The indices into ``params`` of those that got no gradient on at least one rank: DDP
        without ``find_unused_parameters`` would wait for them forever (and fail at the next
        step).
    """
    world = dist.get_world_size()
    if not params:
        return []
    device = params[0].device
    got = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(got)
    counts = got.tolist()
    grads = []
    for p, n in zip(params, counts):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)

    def mean(flat: torch.Tensor) -> None:
        flat.div_(world)
        dist.all_reduce(flat)

    _collective(grads, mean)
    return [i for i, n in enumerate(counts) if n < world]
