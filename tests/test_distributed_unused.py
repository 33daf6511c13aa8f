"""DDP's find_unused_parameters decided by the first step (TrainConfig's default, None): off
when every trainable parameter gets a gradient, so DDP never warns that it found none; on when
one does not, on any rank; the first step's gradients averaged by hand equal DDP's; a parameter
unused only later, or with the option set false, is an error naming the option. Two gloo
processes on tiny modules."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from rag_fast.training import TrainConfig, Trainer
from rag_fast.training.distributed import spawn

DDP_WARNING = "did not find any unused parameters"


class Net(nn.Module):
    """``a`` always used; ``b`` used per ``use_b``: "always", "never", "rank0" (on rank 0 only),
    "first" (in the first step only)."""

    def __init__(self, use_b: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)
        self.use_b, self.calls = use_b, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        use = {"always": True, "never": False, "rank0": rank == 0,
               "first": self.calls == 1}[self.use_b]
        return self.a(x) + self.b(x) if use else self.a(x)


def dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return list(torch.randn(16, 5, generator=g))


def loss_fn(module, batch: torch.Tensor) -> torch.Tensor:
    return ((module(batch[:, :4]).squeeze(1) - batch[:, 4]) ** 2).mean()


def collate(rows):
    return torch.stack(rows)


def train(use_b: str, setting, micro_batch_size: int, steps: int = 3):
    model = Net(use_b)
    trainer = Trainer(model, dataset(), collate, loss_fn,
                      TrainConfig(max_steps=steps, micro_batch_size=micro_batch_size, lr=0.1,
                                  progress=False, find_unused_parameters=setting))
    trainer.train()
    return trainer, {n: p.detach().clone() for n, p in model.named_parameters()}


# DDP warns once per process: the control that it warns (set true, every parameter used)
# comes after the cases that must not warn, and "rank0" (where rank 0, using every
# parameter, warns although rank 1 needs the search) after it
CASES = [("always", None), ("never", None), ("first", None), ("never", False),
         ("always", True), ("rank0", None)]


def _worker(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    # DDP's C++ warnings go to the process's stderr: kept in a file per rank
    err = open(os.path.join(out, f"stderr-{rank}.txt"), "w")
    os.dup2(err.fileno(), 2)
    results = []
    for use_b, setting in CASES:
        before = os.path.getsize(os.path.join(out, f"stderr-{rank}.txt"))
        try:
            trainer, params = train(use_b, setting, micro_batch_size=2)
            result = {"find_unused": trainer.ddp.find_unused_parameters,
                      "unused": trainer.unused_parameters,
                      "params": {n: p.tolist() for n, p in params.items()}}
        except ValueError as e:
            result = {"error": str(e)}
        torch.distributed.barrier()
        with open(os.path.join(out, f"stderr-{rank}.txt")) as f:
            f.seek(before)
            result["warned"] = DDP_WARNING in f.read()
        results.append(result)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("unused")
    spawn(_worker, 2, str(out))
    return [dict(zip(CASES, json.loads((out / f"rank-{r}.json").read_text()))) for r in range(2)]


def test_every_parameter_used_runs_ddp_without_the_search_and_no_warning(ranks):
    for rank in ranks:
        got = rank[("always", None)]
        assert got["find_unused"] is False and got["unused"] == [] and not got["warned"]
    # the control: set true on the same model, DDP warns (the check sees its warning)
    assert all(rank[("always", True)]["find_unused"] is True and rank[("always", True)]["warned"]
               for rank in ranks)


@pytest.mark.parametrize("use_b", ["never", "rank0"])
def test_a_parameter_unused_on_any_rank_turns_the_search_on(ranks, use_b):
    for rank in ranks:
        got = rank[(use_b, None)]
        assert got["find_unused"] is True and got["unused"] == ["b.weight", "b.bias"]
    assert not ranks[0][("never", None)]["warned"]


@pytest.mark.parametrize("use_b", ["always", "never"])
def test_the_first_step_averages_as_ddp_does(ranks, use_b):
    """The same parameters as one process with the same global batch; an unused parameter is
    never changed."""
    _, single = train(use_b, None, micro_batch_size=4)
    for rank in ranks:
        params = rank[(use_b, None)]["params"]
        for name, value in single.items():
            torch.testing.assert_close(torch.tensor(params[name]), value, rtol=1e-5, atol=1e-6,
                                       msg=name)
    if use_b == "never":
        assert torch.equal(single["b.weight"], Net("never").b.weight.detach())


@pytest.mark.parametrize("use_b,setting,how", [
    ("first", None, "every trainable parameter got one in the first step, which decided it"),
    ("never", False, "the config sets find_unused_parameters false"),
])
def test_a_parameter_unused_later_names_it_and_the_option(ranks, use_b, setting, how):
    """Said in the step it happens, before its optimizer step (DDP would fail only at the
    next one, after a step whose gradients it did not average)."""
    step = 2 if use_b == "first" else 1
    for rank in ranks:
        assert rank[(use_b, setting)]["error"] == (
            f"step {step}: no gradient for the trainable parameters b.weight, b.bias, and DDP "
            f"runs without find_unused_parameters ({how}): set train.find_unused_parameters to "
            "true (rag-fast train --set train.find_unused_parameters=true)")


def test_one_process_needs_no_decision():
    trainer, _ = train("never", None, micro_batch_size=4, steps=1)
    assert trainer.ddp is None and trainer.find_unused_parameters is None
