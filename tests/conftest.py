"""Test configuration: markers skip exactly what is missing, and in CI nothing may be missing
except a GPU (the extension must be built, Triton must run under its interpreter)."""
from __future__ import annotations

import os

# Triton reads this at import time; the CPU interpreter is how Triton kernels run in tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from utils import IN_CI, ext_available, triton_cpu_available  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    have = {
        "requires_ext": ext_available(),
        "requires_triton": torch.cuda.is_available() or triton_cpu_available(),
    }
    if IN_CI:
        missing = [name for name, ok in have.items() if not ok]
        if missing:
            raise pytest.UsageError(f"CI must be able to run every test; missing: {missing}")
    for item in items:
        for name, ok in have.items():
            if not ok and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=f"{name}: not available here"))
