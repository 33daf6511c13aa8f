"""``python -m rag_fast.info``: what this installation can use.

Prints versions (rag_fast, torch, transformers, faiss, triton) and which backends are usable:
the C++ extension with its SIMD level and thread count, Triton, CUDA and faiss GPU support.
Without the extension it ends with why (e.g. a source checkout was imported) and the fix.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
import warnings

import rag_fast
from rag_fast import _ext
from rag_fast.kernels import triton_status


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _faiss_info() -> tuple[str, str]:
    try:
        faiss = importlib.import_module("faiss")
    except Exception as exc:
        return "not importable", f"no ({type(exc).__name__}: {exc})"
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    return getattr(faiss, "__version__", "?"), (f"yes ({gpus} GPUs)" if gpus else "no")


def _triton_info() -> tuple[str, str]:
    return triton_status()


def collect() -> dict[str, str]:
    """Everything ``python -m rag_fast.info`` prints, as a dict of strings."""
    import torch

    info: dict[str, str] = {
        "rag_fast": rag_fast.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
    }
    faiss_version, faiss_gpu = _faiss_info()
    info["faiss"] = faiss_version
    triton_version, triton_usable = _triton_info()
    info["triton"] = triton_version
    if _ext.available():
        C = _ext.get()
        info["C++ extension"] = "available"
        info["C++ SIMD level"] = C.simd_level()
        info["C++ threads"] = str(C.num_threads())
    else:
        info["C++ extension"] = f"UNAVAILABLE ({_ext.error()}), see WARNING below"
    info["Triton kernels"] = triton_usable
    if torch.cuda.is_available():
        info["CUDA"] = f"yes ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} devices)"
    else:
        info["CUDA"] = "no"
    info["faiss GPU"] = faiss_gpu
    info["torch threads"] = str(torch.get_num_threads())
    info["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "0")
    return info


def main() -> None:
    with warnings.catch_warnings():  # the extension's warning is printed below, in full
        warnings.filterwarnings("ignore", message=r"rag_fast C\+\+ extension unavailable")
        info = collect()
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    if _ext.diagnosis() is not None:
        print(f"\nWARNING: {_ext.diagnosis()}")


if __name__ == "__main__":
    main()
