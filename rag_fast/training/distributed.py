"""Process groups for data-parallel training: one process per device, gloo on CPU, nccl on GPU.

``rag-fast train`` under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR set) joins the group with
:func:`init_from_env`; :func:`spawn` starts ``world_size`` local processes (tests, one machine);
:func:`world` is this process's rank and the group's size.
"""
from __future__ import annotations

import os
import socket
from typing import Callable

import torch
import torch.distributed as dist


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
