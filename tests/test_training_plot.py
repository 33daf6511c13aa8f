"""The training plot: eval metrics in panels by scale, so that none is drawn flat against
another's scale or hidden under another's line."""
import matplotlib.image

from rag_fast.training.checkpoint import TrainState
from rag_fast.training.plot import metric_panels, plot_training


def _series(**values):
    return {name: [(10, v), (20, v)] for name, v in values.items()}


def test_metrics_are_grouped_by_scale():
    series = _series(eval_loss=3.2, em=0.5, f1=0.5, **{"recall@3": 1.0}, tokens=1234.0,
                     nll=2.0, bleu1=0.25)
    assert metric_panels(series) == [("loss", ["eval_loss", "nll"]),
                                     ("fraction (0-1)", ["em", "f1", "recall@3", "bleu1"]),
                                     ("tokens", ["tokens"])]


def test_a_metric_leaving_0_1_gets_its_own_panel():
    series = {"f1": [(1, 0.2), (2, 0.4)], "score": [(1, 0.5), (2, 1.5)]}
    assert metric_panels(series) == [("loss", []), ("fraction (0-1)", ["f1"]),
                                     ("score", ["score"])]


def test_no_evals_is_the_loss_panel_alone():
    assert metric_panels({}) == [("loss", [])]


def test_the_plot_has_one_panel_per_scale(tmp_path):
    state = TrainState(step=20, history=[(10, 4.0), (20, 3.0)],
                       evals=[(10, {"loss": 3.5, "em": 0.1, "f1": 0.1, "recall@3": 0.9}),
                              (20, {"loss": 3.1, "em": 0.2, "f1": 0.3, "recall@3": 0.9})])
    alone = TrainState(step=20, history=[(10, 4.0), (20, 3.0)])
    for s, name in ((state, "evals.png"), (alone, "alone.png")):
        assert plot_training(s, str(tmp_path / name)) is True
    # 1.5 + 2.5 inches per panel at 100 dpi: two panels with evals, one without
    assert matplotlib.image.imread(tmp_path / "evals.png").shape[0] == 650
    assert matplotlib.image.imread(tmp_path / "alone.png").shape[0] == 400
