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


def plotted_number(value: Any) -> float | None:
    """A metric as a float, or None when it is not a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    return None


_warned_no_matplotlib = False


# metrics told apart on a shared panel: a marker and a line style each
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", ":", "-.")


def metric_panels(series: dict[str, list]) -> list[tuple[str, list[str]]]:
    """Eval metrics grouped by scale, one plot panel each: ``[(y label, [names])]``.

    A metric named like a loss (``loss``, ``nll``, ``perplexity`` in its name) goes with the
    training loss (the first panel, labelled ``"loss"``, present even without one); metrics
    whose every value lies in [0, 1] (exact match, F1, recall@k, BLEU, ROUGE) share a
    ``"fraction (0-1)"`` panel; any other metric gets a panel of its own, so that no metric is
    drawn flat against another's scale."""
    loss, fractions, own = [], [], []
    for name, points in series.items():
        values = [v for _, v in points]
        if any(word in name.lower() for word in ("loss", "nll", "perplexity")):
            loss.append(name)
        elif all(0.0 <= v <= 1.0 for v in values):
            fractions.append(name)
        else:
            own.append(name)
    panels = [("loss", loss)]
    if fractions:
        panels.append(("fraction (0-1)", fractions))
    panels += [(name, [name]) for name in own]
    return panels


def plot_training(state: TrainState, path: str) -> bool:
    """A PNG (written atomically) of the logged training loss vs step, with the eval metrics in
    panels by scale (:func:`metric_panels`): eval losses beside the training loss, metrics in
    [0, 1] together (each with its own marker and line style, so that equal values stay
    visible), any other metric alone; matplotlib's Agg canvas, no pyplot.

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
            if (value := plotted_number(value)) is not None:
                series.setdefault(name, []).append((step, value))
    panels = metric_panels(series)
    fig = Figure(figsize=(7, 1.5 + 2.5 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    if state.history:
        steps, losses = zip(*state.history)
        axes[0].plot(steps, [math.nan if v is None else v for v in losses], marker=".",
                     label="training loss")
    for ax, (label, names) in zip(axes, panels):
        for i, name in enumerate(names):
            ax.plot(*zip(*series[name]), marker=_MARKERS[i % len(_MARKERS)],
                    linestyle=_LINES[i % len(_LINES)], label=f"eval {name}", alpha=0.85)
        if label == "fraction (0-1)":
            ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[-1].set_xlabel("step")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return True
