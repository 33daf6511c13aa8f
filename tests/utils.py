"""The one tolerance rule and the helpers the tests share.

A kernel's error against the float64 reference may be at most twice the error of the plain
PyTorch version computed in the same dtype, plus a small floor per dtype.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 1e-3, torch.float64: 1e-12}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference, treating matching infinities and NaNs as equal."""
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_rule(
    actual: torch.Tensor, plain: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype, what: str
) -> None:
    """``|actual - oracle| <= 2 |plain - oracle| + floor(dtype)``, scaled by the oracle's size."""
    assert actual.shape == oracle.shape, f"{what}: shape {actual.shape} != {oracle.shape}"
    scale = max(1.0, float(oracle.double().abs().nan_to_num(0, 0, 0).max()) if oracle.numel() else 1.0)
    err = max_err(actual, oracle)
    plain_err = max_err(plain, oracle)
    bound = 2 * plain_err + FLOOR[dtype] * scale
    assert err <= bound, f"{what}: error {err:.3g} > bound {bound:.3g} (plain {plain_err:.3g})"


def ext_available() -> bool:
    from rag_fast import _ext

    return _ext.available()


def triton_cpu_available() -> bool:
    from rag_fast.kernels import triton_usable_for

    return triton_usable_for("cpu")


requires_ext = pytest.mark.requires_ext
requires_triton = pytest.mark.requires_triton
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

IN_CI = os.environ.get("CI") == "true"


def run_python(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` in the tests folder, so the child imports the installed rag_fast, not
    the source checkout (which has no compiled extension after a non-editable install)."""
    return subprocess.run([sys.executable, *args], cwd=os.path.dirname(os.path.abspath(__file__)),
                          capture_output=True, text=True, **kwargs)
