"""pytest-benchmark micro-benchmarks of rag_fast's kernels (benchmarks/test_*.py).

Run from the repository root (the CI test command, ``pytest tests``, never collects them):

    pytest benchmarks --benchmark-only --benchmark-autosave      # save a run in .benchmarks/
    pytest benchmarks --benchmark-only --benchmark-compare       # compare with the last saved run
    pytest benchmarks --benchmark-disable                        # run each case once (a check)

Sizes: ``--micro-size small`` (default; the suite takes well under a minute) or ``full``
(the shapes of the README's tables); the environment variable ``RAG_FAST_MICRO_SIZE`` sets the
default. Each case runs rag_fast's kernel (``impl="cpp"``: it fails, never falls back, without
the compiled extension) and the plain PyTorch reference (``impl="torch"``) in one group, so
pytest-benchmark's table shows their ratio, and each checks its result against a float64
oracle, so a broken kernel fails instead of looking fast. ``benchmarks/run.py`` stays the
place for the README's tables; these only track regressions between commits.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

SIZES = ("small", "full")
_SIZE_ENV = "RAG_FAST_MICRO_SIZE"


def pytest_addoption(parser):
    group = parser.getgroup("rag_fast micro-benchmarks")
    group.addoption(
        "--micro-size", choices=SIZES, default=None,
        help=f"shapes of the micro-benchmarks: small (default, well under a minute) or full "
             f"(the README's shapes); default from ${_SIZE_ENV}",
    )


def _size(config) -> str:
    size = config.getoption("--micro-size") or os.environ.get(_SIZE_ENV, "small")
    if size not in SIZES:
        raise pytest.UsageError(f"{_SIZE_ENV} must be one of {SIZES}, got {size!r}")
    return size


# pytest-benchmark reports what it cannot do (compare with no saved run, save nothing) as
# warnings; the project's "error" filter would turn the first into an internal error. They stay
# visible warnings here; any other warning is still an error.
_BENCHMARK_NOTICE = "default::pytest_benchmark.logger.PytestBenchmarkWarning"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    _size(config)  # a bad environment value fails before anything runs
    config.addinivalue_line("filterwarnings", _BENCHMARK_NOTICE)  # the later phases
    from pytest_benchmark.logger import PytestBenchmarkWarning

    warnings.filterwarnings("default", category=PytestBenchmarkWarning)  # this phase


def pytest_report_header(config):
    from rag_fast import _ext

    ext = (f"C++ extension {_ext.get().simd_level()}, {_ext.get().num_threads()} threads"
           if _ext.available() else "C++ extension NOT available (the cpp cases will fail)")
    return [f"rag_fast micro-benchmarks: size {_size(config)}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), {ext}"]


def pytest_benchmark_update_machine_info(config, machine_info):
    """Saved with every run: what a comparison between two saved runs must hold equal."""
    from rag_fast import _ext

    machine_info["rag_fast"] = {
        "micro_size": _size(config),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "simd_level": _ext.get().simd_level() if _ext.available() else None,
        "kernel_threads": _ext.get().num_threads() if _ext.available() else None,
    }


@pytest.fixture(scope="session")
def micro_size(request) -> str:
    """``"small"`` or ``"full"`` (``--micro-size``)."""
    return _size(request.config)
