"""The training plot: logged loss and evaluation metrics vs step, as a PNG (matplotlib is
optional: without it there is no plot)."""
from __future__ import annotations

import math
import warnings
from numbers import Real
from typing import Any

import numpy as np
import torch

from rag_fast.storage import atomic_write
from rag_fast.training.checkpoint import TrainState


def _number(value: Any) -> float | None:
    """A metric as a float, or None when it is not a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    return None


_warned_no_matplotlib = False


def plot_training(state: TrainState, path: str) -> bool:
    """A PNG (written atomically) of the logged loss vs step, and of each eval metric vs step
    in a second panel when there are evals; matplotlib's Agg canvas, no pyplot.

    Returns:
        Whether it was written: False, with one warning per process, without matplotlib.
    """
    global _warned_no_matplotlib
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        if not _warned_no_matplotlib:
            _warned_no_matplotlib = True
            warnings.warn(f"matplotlib is not installed: no training plot {path} "
                          "(pip install matplotlib)", stacklevel=2)
        return False
    series: dict[str, list] = {}
    for step, metrics in state.evals:
        for name, value in metrics.items():
            if (value := _number(value)) is not None:
                series.setdefault(name, []).append((step, value))
    fig = Figure(figsize=(7, 6 if series else 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if series else 1, 1, sharex=True, squeeze=False)[:, 0]
    if state.history:
        steps, losses = zip(*state.history)
        axes[0].plot(steps, [math.nan if v is None else v for v in losses], marker=".")
    axes[0].set_ylabel("training loss")
    for name, points in series.items():
        axes[1].plot(*zip(*points), marker="o", label=name)
    if series:
        axes[1].set_ylabel("eval")
        axes[1].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return True
