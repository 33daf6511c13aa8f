"""Training loop: a killed run resumes to the same parameters, DDP equals one process,
schedules, accumulation, autocast and configuration errors."""
from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from rag_fast.models import RagModel
from rag_fast.testing import tiny_hf_rag
from rag_fast.training import TrainConfig, Trainer, lr_lambda
from rag_fast.training.distributed import spawn

K, L, T, N = 2, 6, 5, 16


def _no_dropout(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)


def make_model(dropout: bool = True) -> RagModel:
    """A tiny RAG-Token model whose question encoder is trained through the passage scores."""
    hf = tiny_hf_rag("token", seed=0, n_docs=K)
    model = RagModel.from_transformers(hf)
    if not dropout:
        _no_dropout(model)
    return model


def make_dataset() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    data = []
    for _ in range(N):
        labels = torch.randint(3, 50, (T,), generator=g)
        labels[0] = 0
        data.append({"q": torch.randint(3, 99, (4,), generator=g),
                     "e": torch.randn(K, 16, generator=g),
                     "ctx": torch.randint(3, 50, (K, L), generator=g), "labels": labels})
    return data


def collate(examples: list[dict]) -> dict:
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def loss_fn(module, batch: dict) -> torch.Tensor:
    ctx = batch["ctx"].flatten(0, 1)  # [B*K, L]
    return module(batch["labels"], question_input_ids=batch["q"], passage_embeddings=batch["e"],
                  context_input_ids=ctx, context_attention_mask=torch.ones_like(ctx)).loss


def config(**kw) -> TrainConfig:
    base = dict(max_steps=6, micro_batch_size=4, lr=1e-2, warmup_steps=2, progress=False,
                seed=3)
    return TrainConfig(**{**base, **kw})


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _killed_run(out_dir: str) -> None:
    def die(state):
        if state.step == 3:  # step 3 is done but only step 2 was checkpointed
            os._exit(17)

    model = make_model()
    Trainer(model, make_dataset(), collate, loss_fn,
            config(output_dir=out_dir, checkpoint_every=2), on_step_end=die).train()


def test_killed_run_resumes_to_same_parameters(tmp_path):
    reference = make_model()
    Trainer(reference, make_dataset(), collate, loss_fn, config()).train()

    proc = multiprocessing.get_context("spawn").Process(target=_killed_run, args=(str(tmp_path),))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 17
    # atomic: no temporaries left; a logged step is yet to come (log_every 10)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-last.json", "checkpoint-last.pt",
                                            "rag_fast-output.json"]

    resumed = make_model()
    trainer = Trainer(resumed, make_dataset(), collate, loss_fn,
                      config(output_dir=str(tmp_path), checkpoint_every=2))
    assert trainer.resume()
    assert trainer.state.step == 2
    trainer.train()
    for name, value in params(reference).items():
        torch.testing.assert_close(params(resumed)[name], value, rtol=0, atol=0, msg=name)


def _ddp_worker(rank: int, world_size: int, out: str, find_unused) -> None:
    torch.set_num_threads(1)
    model = make_model(dropout=False)
    trainer = Trainer(model, make_dataset(), collate, loss_fn,
                      ddp_config(micro_batch_size=2, find_unused_parameters=find_unused))
    trainer.train()
    assert trainer.ddp.find_unused_parameters is False  # every parameter is trained
    if rank == 0:
        torch.save(params(model), out)


def ddp_config(micro_batch_size: int, find_unused_parameters=False) -> TrainConfig:
    # adam_eps: with the default 1e-8, Adam turns rounding noise in near-zero gradients (the
    # tiny question encoder's) into lr-sized updates, so runs that sum in a different order
    # drift apart by ~1e-3 although their gradients agree to float precision.
    return config(micro_batch_size=micro_batch_size, max_steps=4, adam_eps=1e-3,
                  find_unused_parameters=find_unused_parameters)


@pytest.mark.slow
@pytest.mark.parametrize("find_unused", [False, None])  # None: the first step decides
def test_two_process_ddp_equals_one_process_same_global_batch(tmp_path, find_unused):
    single = make_model(dropout=False)
    Trainer(single, make_dataset(), collate, loss_fn, ddp_config(micro_batch_size=4)).train()
    out = str(tmp_path / "ddp.pt")
    spawn(_ddp_worker, 2, out, find_unused)
    ddp = torch.load(out)
    for name, value in params(single).items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert any((v != params(make_model())[n]).any() for n, v in ddp.items())  # it trained


def test_accumulation_equals_large_batch():
    big = make_model(dropout=False)
    Trainer(big, make_dataset(), collate, loss_fn,
            config(max_steps=2, micro_batch_size=8, adam_eps=1e-3)).train()
    acc = make_model(dropout=False)
    Trainer(acc, make_dataset(), collate, loss_fn,
            config(max_steps=2, micro_batch_size=4, grad_accum=2, adam_eps=1e-3)).train()
    for name, value in params(big).items():  # adam_eps: see ddp_config
        torch.testing.assert_close(params(acc)[name], value, rtol=1e-4, atol=1e-5, msg=name)


def _linear_output_dtypes(model) -> set:
    """The dtypes the model's Linear layers output while it trains (filled in by hooks)."""
    seen = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    return seen


def test_bf16_autocast_and_gradient_checkpointing_train():
    model = make_model()
    seen = _linear_output_dtypes(model)
    trainer = Trainer(model, make_dataset(), collate, loss_fn,
                      config(max_steps=4, precision="bf16", gradient_checkpointing=True,
                             log_every=1, lr=3e-3))
    state = trainer.train()
    losses = [loss for _, loss in state.history]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert model.generator.is_gradient_checkpointing
    # autocast really ran: the forward's matrix products were bf16 (fp32 parameters)...
    assert seen == {torch.bfloat16}, seen
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # ...and the same run in fp32 (matrix products in fp32) gives other losses
    fp32 = make_model()
    seen32 = _linear_output_dtypes(fp32)
    state32 = Trainer(fp32, make_dataset(), collate, loss_fn,
                      config(max_steps=4, precision="fp32", gradient_checkpointing=True,
                             log_every=1, lr=3e-3)).train()
    losses32 = [loss for _, loss in state32.history]
    assert seen32 == {torch.float32}, seen32
    assert len(losses32) == 4 and losses != losses32, (losses, losses32)


def test_progress_bar_and_periodic_eval(capsys):
    model = make_model()
    calls = []
    trainer = Trainer(model, make_dataset(), collate, loss_fn,
                      config(max_steps=2, progress=True, eval_every=1),
                      eval_fn=lambda m: calls.append(1) or {"em": 0.5})
    state = trainer.train()
    assert len(calls) == 2 and state.evals[-1] == (2, {"em": 0.5})
    err = capsys.readouterr().err
    assert "ex_per_s" in err and "loss" in err


def test_schedule_warmup_then_linear_decay():
    f = lr_lambda(TrainConfig(max_steps=10, warmup_steps=2))
    assert [round(f(s), 3) for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]


def test_bad_training_input():
    with pytest.raises(ValueError, match="training dataset is empty"):
        Trainer(make_model(), [], collate, loss_fn, config())
    with pytest.raises(ValueError, match="precision must be one of"):
        config(precision="fp8")
    with pytest.raises(ValueError, match="unknown training option 'max_step'"):
        TrainConfig.from_dict({"max_step": 3})
    with pytest.raises(ValueError, match="larger than the dataset"):
        Trainer(make_model(), make_dataset()[:3], collate, loss_fn, config())


def test_optimizer_is_fused_adamw_where_every_parameter_allows_it():
    from rag_fast.training.optim import make_optimizer

    config = TrainConfig(max_steps=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = make_optimizer(model, config)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"]
    # decay on matrices only
    assert [g["weight_decay"] for g in opt.param_groups] == [config.weight_decay, 0.0]
    model.to(torch.float64)
    assert make_optimizer(model, config).defaults["fused"]
    mixed = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Embedding(3, 2)])
    mixed[1].weight.data = mixed[1].weight.data.to(torch.complex64)  # fused AdamW: no complex
    assert not make_optimizer(mixed, config).defaults["fused"]


def test_a_warm_up_longer_than_the_run_is_clamped_with_a_warning():
    """Shortening max_steps for a quick run keeps the config's warm-up, clamped to the run."""
    with pytest.warns(UserWarning, match="warmup_steps 10 is more than max_steps 3"):
        tc = config(max_steps=3, warmup_steps=10)
    assert tc.warmup_steps == 3


class _Clock:
    """A stand-in for the trainer's ``time`` module: each ``perf_counter()`` call is 1 s later."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("old_checkpoint", [False, True])
def test_elapsed_time_goes_on_across_a_resume(tmp_path, monkeypatch, old_checkpoint):
    """metrics.jsonl's elapsed_s after a resume continues from the checkpoint's elapsed time; a
    checkpoint of an earlier rag_fast (no elapsed_s in its state) counts from 0."""
    import dataclasses
    import json

    from rag_fast.training import checkpoint as checkpoint_module
    from rag_fast.training import trainer as trainer_module

    def elapsed() -> dict[int, float]:
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["elapsed_s"] for r in map(json.loads, lines) if "loss" in r}

    def run(max_steps: int) -> Trainer:
        monkeypatch.setattr(trainer_module, "time", _Clock())  # a fresh clock per session
        trainer = Trainer(make_model(), make_dataset(), collate, loss_fn,
                          config(max_steps=max_steps, warmup_steps=0, log_every=1,
                                 checkpoint_every=2, output_dir=str(tmp_path), plot_file=None))
        trainer.resume()
        trainer.train()
        return trainer

    with monkeypatch.context() as m:
        if old_checkpoint:  # written as an earlier rag_fast wrote it: no elapsed_s in its state
            m.setattr(checkpoint_module, "asdict", lambda state: {
                k: v for k, v in dataclasses.asdict(state).items() if k != "elapsed_s"})
        first = run(2)
    one, two = elapsed()[1], elapsed()[2]
    assert 0 < one < two and first.state.elapsed_s == two
    saved = checkpoint_module.load_checkpoint(str(tmp_path / "checkpoint-last.pt"))["state"]
    assert ("elapsed_s" in saved) is not old_checkpoint
    resumed = run(4)
    base = 0.0 if old_checkpoint else two  # the same clock readings, from the checkpoint's time
    assert elapsed() == {1: one, 2: two, 3: base + one, 4: base + two}
    assert resumed.state.elapsed_s == base + two


def test_compile_option_compiles_both_regions_and_trains_as_eager(monkeypatch):
    """``compile: true`` compiles the question encoder's and the generator + loss's regions
    (aot_eager here: inductor's compile takes minutes on 2 cores; tests/test_compile.py has
    inductor) and trains to the eager run's parameters."""
    eager = make_model(dropout=False)
    Trainer(eager, make_dataset(), collate, loss_fn, config(max_steps=3, adam_eps=1e-3)).train()
    compile_model = RagModel.compile
    monkeypatch.setattr(RagModel, "compile",
                        lambda self, **kw: compile_model(self, **{"backend": "aot_eager", **kw}))
    torch._dynamo.reset()
    compiled = make_model(dropout=False)
    Trainer(compiled, make_dataset(), collate, loss_fn,
            config(max_steps=3, adam_eps=1e-3, compile=True)).train()
    assert compiled.compiled and set(compiled._compiled) == {"encode", "loss"}
    for name, value in params(eager).items():
        torch.testing.assert_close(params(compiled)[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_compile_option_needs_a_rag_model():
    with pytest.raises(ValueError, match="compile: true needs a rag_fast RagModel"):
        Trainer(torch.nn.Linear(2, 2), make_dataset(), collate, loss_fn, config(compile=True))


def test_the_logged_loss_states_its_unit(tmp_path):
    """A metrics line's ``loss`` is per question (each answer's NLL summed over its tokens, the
    mean over the step's questions) and ``loss_per_token`` that sum over the target tokens.
    A newcomer saw losses from 37 down to 13 with no word of what they were per."""
    import json

    model = make_model(dropout=False)
    data = make_dataset()[:4]  # one global batch: the step sees all of them, in any order
    for e, keep in zip(data, (T, 3, 2, T)):  # answers of different lengths
        e["labels"][keep:] = model.pad_token_id
    out = tmp_path / "run"
    trainer = Trainer(model, data, collate, loss_fn,
                      config(output_dir=str(out), max_steps=1, micro_batch_size=2, grad_accum=2,
                             lr=0.0, warmup_steps=0, log_every=1, plot_file=None))
    trainer.train()
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    with torch.no_grad():  # the oracle: the same (untouched, lr 0) weights, per question
        batch = collate(data)
        ctx = batch["ctx"].flatten(0, 1)
        nll = model(batch["labels"], question_input_ids=batch["q"],
                    passage_embeddings=batch["e"], context_input_ids=ctx,
                    context_attention_mask=torch.ones_like(ctx), reduction="none").loss
    targets = int((batch["labels"][:, 1:] != model.pad_token_id).sum())  # after the start
    assert targets == (T - 1) + 2 + 1 + (T - 1)
    assert record["loss"] == pytest.approx(float(nll.mean()), rel=1e-5)
    assert record["loss_per_token"] == pytest.approx(float(nll.sum()) / targets, rel=1e-5)
