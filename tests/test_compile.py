"""torch.compile of rag_fast: the fused losses' custom ops (rag_fast/ops/rag_losses.py) and the
fused LM-head loss's (rag_fast/ops/linear_rag_nll.py) in compiled graphs, and RagModel.compile():
no graph break inside rag_fast, recompiles bounded across batch shapes, and the same losses,
gradients and 20-step parameters as eager (which writes the logits' gradient in place, reuses its
logits buffer and defers a tied head's weight gradient)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch._dynamo

import rag_fast
from rag_fast.models import RagModel
from rag_fast.testing import tiny_hf_rag
from utils import assert_close_rule, requires_ext

pytestmark = requires_ext  # impl="auto" on the CPU: the C++ kernels

B, K, L, T = 2, 3, 7, 6
PACKAGE = str(Path(rag_fast.__file__).resolve().parent)


def _in_rag_fast(frame) -> bool:
    return str(Path(frame.filename).resolve()).startswith(PACKAGE)


def test_inductor_lm_head_and_loss_equal_eager():
    """Inductor generates code around the custom ops (a mutating one in the backward); the
    whole generator would take a minute to compile on two cores, the LM head and loss do not."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B * K, T, 8, generator=g)
    weight = torch.randn(37, 8, generator=g)
    scores = torch.randn(B, K, generator=g)
    targets = torch.randint(0, 37, (B, T), generator=g)
    targets[1, -2:] = -100

    def loss_fn(h, weight, scores, targets):
        logits = h @ weight.t()  # [B*K, T, V]
        token = rag_fast.rag_token_nll(logits, scores, targets, n_docs=K, epsilon=0.1,
                                       reduction="sum")
        return token + rag_fast.rag_sequence_nll(logits, scores, targets, n_docs=K,
                                                 reduction="sum")

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (h, weight, scores)]
        loss = fn(*leaves, targets)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="inductor", fullgraph=True)
    for name, got, want in zip(("loss", "d h", "d weight", "d scores"), run(compiled),
                               run(loss_fn)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_marginal_and_beam_step_compile_in_one_graph():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, K, T, 11, generator=g)
    scores = torch.randn(B, K, generator=g)
    beam_logits = torch.randn(B, 2, K, 11, generator=g)
    beam_scores = torch.randn(B, 2, generator=g)

    def fn(logits, scores):
        marginal = rag_fast.rag_token_marginal(logits, scores)
        prior = torch.log_softmax(scores, dim=1)
        return marginal, rag_fast.rag_token_beam_step(beam_logits, prior, beam_scores)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = logits.clone().requires_grad_()
    (marginal, step), (want_marginal, want_step) = compiled(x, scores), fn(logits, scores)
    torch.testing.assert_close(marginal, want_marginal, rtol=0, atol=0)
    for got, want in zip(step, want_step):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    upstream = torch.randn(marginal.shape, generator=g)
    marginal.backward(upstream)
    want_x = logits.clone().requires_grad_()
    rag_fast.rag_token_marginal(want_x, scores).backward(upstream)
    torch.testing.assert_close(x.grad, want_x.grad, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------- RagModel.compile(): the step
# An encoder-decoder (tiny BART, untied head with a bias) and a decoder-only generator (tiny
# Qwen2, tied embeddings, left-padded prompts), both RAG modes, both LM-head paths: the
# compiled step's loss and gradients, and the parameters after 6 AdamW steps (20 in one case),
# against the
# eager step under the tolerance rule (tests/utils.py: float32 compiled vs float32 eager, with
# the float64 eager step as the oracle). Dropout is off (the models are in eval mode).
# aot_eager traces and differentiates exactly what inductor gets (the custom ops' fake and
# autograd implementations included) in seconds; inductor itself runs in the slow tests.

KINDS = ("encoder-decoder", "decoder-only")
STEPS = 6  # AdamW steps per case: the optimizer's state and the compiled step meet every step
LONG_STEPS = 20  # one case runs longer (rounding that grows over steps would show there)


def _compile_case(kind: str, mode: str, path: str, exclude_bos: bool = False) -> RagModel:
    """A float64 RagModel of ``kind`` (label smoothing on, so every statistic is used);
    ``exclude_bos``: RAG-Sequence's data-dependent BOS rule (encoder-decoder only)."""
    if kind == "encoder-decoder":
        hf = tiny_hf_rag(mode, n_docs=K)
        return RagModel.from_transformers(hf, lm_head_loss=path, epsilon=0.1,
                                          exclude_bos=exclude_bos, bos_token_id=0).double()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=131, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    generator = Qwen2ForCausalLM(cfg).double().eval()
    return RagModel(generator, mode=mode, n_docs=K, lm_head_loss=path, epsilon=0.1)


def _case_batch(kind: str, Bq: int = B, L_: int = L, T_: int = T, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    contexts = torch.randint(3, 50, (Bq * K, L_), generator=g)
    mask = torch.ones_like(contexts)
    if kind == "decoder-only":
        mask[1, :2] = 0  # left padding
        contexts[1, :2] = 1
    else:
        mask[1, -2:] = 0
    scores = torch.randn(Bq, K, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(3, 50, (Bq, T_), generator=g)
    if kind == "encoder-decoder":
        labels[:, 0] = 0  # BOS
    labels[-1, -2:] = 1  # padding
    return contexts, mask, scores, labels


def _train(model: RagModel, batch, steps: int, dtype: torch.dtype):
    """``steps`` AdamW steps over one batch (the passage scores a trained leaf, as the question
    encoder's output would be). Returns (first loss, first gradients by name, parameters
    after the last step by name)."""
    contexts, mask, scores, labels = batch
    s = torch.nn.Parameter(scores.to(dtype))
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([*params.values(), s], lr=1e-3)
    first = None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model.loss_from_contexts(contexts, mask, s, labels)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.to_dense().clone() for n, p in params.items()
                     if p.grad is not None}
            grads["doc_scores"] = s.grad.clone()
            first = (loss.detach().clone(), grads)
        opt.step()
    after = {n: p.detach().clone() for n, p in params.items()}
    after["doc_scores"] = s.detach().clone()
    return first[0], first[1], after


def _assert_compiled_equals_eager(kind, mode, path, backend, steps, exclude_bos=False,
                                  batch=None):
    oracle_model = _compile_case(kind, mode, path, exclude_bos)
    batch = _case_batch(kind) if batch is None else batch
    oracle = _train(copy.deepcopy(oracle_model), batch, steps, torch.float64)
    plain = _train(copy.deepcopy(oracle_model).float(), batch, steps, torch.float32)
    torch._dynamo.reset()
    compiled_model = copy.deepcopy(oracle_model).float().compile(backend=backend)
    actual = _train(compiled_model, batch, steps, torch.float32)
    assert compiled_model._compiled, "the compiled region never ran"
    assert_close_rule(actual[0], plain[0], oracle[0], torch.float32, "loss")
    assert actual[1].keys() == oracle[1].keys()
    for what, index in (("gradient", 1), (f"parameter after {steps} steps", 2)):
        for name, want in oracle[index].items():
            # the scores' gradient is posterior minus prior per passage: O(1) terms that
            # cancel to about 0 for a random generator (the rule's absolute floor, float32's
            # rounding of such terms)
            atol = 1e-6 if name == "doc_scores" and index == 1 else 0.0
            assert_close_rule(actual[index][name], plain[index][name], want, torch.float32,
                              f"{kind} {mode} {path}: {what} {name}", atol=atol)


@pytest.mark.parametrize("path", ["fused", "materialized"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_model_equals_eager_over_steps(kind, mode, path):
    _assert_compiled_equals_eager(kind, mode, path, "aot_eager", STEPS)


def test_compiled_model_equals_eager_over_20_steps():
    _assert_compiled_equals_eager("decoder-only", "token", "fused", "aot_eager", LONG_STEPS)


@pytest.mark.parametrize("starts_with_bos", [True, False])
@pytest.mark.parametrize("path", ["fused", "materialized"])
def test_compiled_exclude_bos_equals_eager(path, starts_with_bos):
    """RAG-Sequence's exclude_bos (drop target position 0 from the NLL only if every target
    starts with BOS) is decided in the graph: both outcomes equal eager over the steps, and the
    flag changes the loss exactly when every target starts with BOS."""
    contexts, mask, scores, labels = _case_batch("encoder-decoder")
    labels[:, 1] = 0  # the targets are labels[:, 1:]: each starts with BOS (id 0)
    if not starts_with_bos:
        labels[1, 1] = 7  # one target without BOS: position 0 stays in the NLL
    batch = (contexts, mask, scores, labels)
    losses = [_compile_case("encoder-decoder", "sequence", path, flag).loss_from_contexts(
        contexts, mask, scores, labels).detach() for flag in (True, False)]
    assert torch.equal(*losses) != starts_with_bos, losses
    _assert_compiled_equals_eager("encoder-decoder", "sequence", path, "aot_eager", STEPS,
                                  exclude_bos=True, batch=batch)


@pytest.mark.slow
@pytest.mark.parametrize("kind,mode,path", [("encoder-decoder", "token", "materialized"),
                                            ("decoder-only", "sequence", "fused")])
def test_inductor_compiled_model_equals_eager(kind, mode, path):
    _assert_compiled_equals_eager(kind, mode, path, "inductor", LONG_STEPS)


@pytest.mark.parametrize("path", ["fused", "materialized"])
@pytest.mark.parametrize("kind,mode,exclude_bos", [*((k, "token", False) for k in KINDS),
                                                   ("encoder-decoder", "sequence", True)])
def test_compiled_regions_have_no_graph_break_in_rag_fast(kind, mode, exclude_bos, path):
    model = _compile_case(kind, mode, path, exclude_bos).float()
    contexts, mask, scores, labels = _case_batch(kind)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model._loss_with_activations)(
        contexts, mask, scores.float().requires_grad_(), labels, "mean")
    _assert_no_break_in_rag_fast(explained)
    ops = {str(node.target) for g in explained.graphs for node in g.graph.nodes
           if node.op == "call_function"}
    # both LM-head paths are rag_fast.linear_rag_nll's custom op in a compiled graph
    assert str(torch.ops.rag_fast.linear_rag_stats) in ops, sorted(ops)
    if kind == "encoder-decoder":  # the question encoder's region (DPR, then pooling)
        q = torch.randint(3, 90, (B, 6))
        explained = torch._dynamo.explain(model._encode_questions)(q, torch.ones_like(q))
        _assert_no_break_in_rag_fast(explained)
        assert explained.graph_count == 1 and explained.graph_break_count == 0


def _assert_no_break_in_rag_fast(explained) -> None:
    ours = [r for r in explained.break_reasons if r.user_stack and _in_rag_fast(r.user_stack[-1])]
    assert not ours, "graph breaks in rag_fast:\n" + "\n".join(
        f"{r.reason.splitlines()[0]} at {r.user_stack[-1].filename}:{r.user_stack[-1].lineno}"
        for r in ours)


@pytest.mark.parametrize("kind", KINDS)
def test_recompiles_stay_bounded_across_batch_shapes(kind):
    """Batches of other context and label lengths (and one other batch size): the first shape
    compiles static, the second marks the changed sizes dynamic (torch.compile's automatic
    dynamic shapes), and from then on nothing recompiles; every loss equals eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _compile_case(kind, "token", "materialized").float()
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    model.compile(backend=counter)
    # static; lengths dynamic; the batch dynamic; then new lengths and a new batch with them
    shapes = [(2, 7, 5), (2, 9, 6), (3, 12, 4), (2, 16, 9), (4, 5, 3)]
    frames = []
    for i, (Bq, L_, T_) in enumerate(shapes):
        contexts, mask, scores, labels = _case_batch(kind, Bq, L_, T_, seed=i)
        got = model.loss_from_contexts(contexts, mask, scores.float(), labels)
        want = eager.loss_from_contexts(contexts, mask, scores.float(), labels)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        frames.append(counter.frame_count)
    # static, then lengths dynamic, then the batch size dynamic: 3, never more
    assert frames[-1] <= 3 and frames[2:] == [frames[2]] * len(frames[2:]), frames


def test_linear_rag_nll_compiles_to_its_custom_ops_with_several_tiles():
    """The fused LM-head loss alone, fullgraph, tiles of 16 columns, keeping the logits or not,
    a bias with gradient: the same loss and gradients as eager."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(B * K, T, 8, generator=g)
    weight = torch.randn(37, 8, generator=g)
    bias = torch.randn(37, generator=g)
    scores = torch.randn(B, K, generator=g)
    targets = torch.randint(0, 37, (B, T), generator=g)
    targets[1, -2:] = -100

    def run(fn, keep):
        leaves = [t.clone().requires_grad_() for t in (h, weight, bias, scores)]
        loss = fn(*leaves, keep)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    for mode, epsilon in (("token", 0.1), ("sequence", 0.1), ("token", 0.0)):
        def loss_fn(h, w, b, s, keep):
            return rag_fast.linear_rag_nll(h, w, s, targets, bias=b, mode=mode, n_docs=K,
                                           epsilon=epsilon, tile=16, keep_logits=keep,
                                           reduction="sum")
        for keep in (False, True):
            torch._dynamo.reset()
            compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
            for name, got, want in zip(("loss", "d h", "d weight", "d bias", "d scores"),
                                       run(compiled, keep), run(loss_fn, False)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{mode} {keep} {name}: {m}")


def test_kept_logits_refuse_a_second_backward():
    """keep_logits writes the logits' gradient over them: a second backward through the same
    call raises instead of reading the overwritten values."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(B * K, T, 8, generator=g, requires_grad=True)
    weight = torch.randn(37, 8, generator=g, requires_grad=True)
    scores = torch.randn(B, K, generator=g)
    targets = torch.randint(0, 37, (B, T), generator=g)
    loss = rag_fast.linear_rag_nll(h, weight, scores, targets, n_docs=K, keep_logits=True,
                                   reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


_BACKEND_GRAPHS: list = []


def _recording_backend(gm, example_inputs):
    """aot_eager, counting the graphs it is handed (module level: a pickled model names it)."""
    from torch._dynamo.backends.debugging import aot_eager

    _BACKEND_GRAPHS.append(gm)
    return aot_eager(gm, example_inputs)


def test_compile_survives_copies_and_replace():
    """A deep copy or pickle of a compiled model compiles its own code at its first step (the
    compiled callables are never copied); replace() keeps the compile options."""
    import pickle

    torch._dynamo.reset()
    model = _compile_case("encoder-decoder", "token", "materialized").float()
    eager = _compile_case("encoder-decoder", "token", "materialized").float()  # the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
    model.compile(backend=_recording_backend)
    batch = _case_batch("encoder-decoder")
    contexts, mask, scores, labels = batch

    def loss_of(m):
        return m.loss_from_contexts(contexts, mask, scores.float(), labels)

    _BACKEND_GRAPHS.clear()
    torch.testing.assert_close(loss_of(model), loss_of(eager))
    assert set(model._compiled) == {"loss"} and _BACKEND_GRAPHS  # compiled, by this backend
    # replace(): the same modules in another mode, compiled with the same options: its loss is
    # the sequence loss (not the token loss of model's compiled code)
    other = model.replace(mode="sequence")
    assert other.compiled and other._compiled == {}
    assert other._compile_options == model._compile_options
    _BACKEND_GRAPHS.clear()
    loss = loss_of(other)
    assert torch.isfinite(loss) and set(other._compiled) == {"loss"} and _BACKEND_GRAPHS
    torch.testing.assert_close(loss, loss_of(eager.replace(mode="sequence")))
    assert not torch.allclose(loss, loss_of(eager))
    # copies: their own code, over their own weights (model's are changed after the copy, so
    # model's compiled code, or its parameters, would give another loss)
    copies = (copy.deepcopy(model), pickle.loads(pickle.dumps(model)))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)
    changed = loss_of(model)
    for other in copies:
        assert other.compiled and other._compiled == {}
        assert other._compile_options == model._compile_options
        loss = loss_of(other)
        assert torch.isfinite(loss) and set(other._compiled) == {"loss"}
        torch.testing.assert_close(loss, loss_of(eager))
        assert not torch.allclose(loss, changed)


@pytest.mark.parametrize("settings,message", [
    (dict(backend="no-such-backend"), "torch.compile refused these settings.*no-such-backend"),
    (dict(mode="fastest"), "torch.compile refused these settings.*mode=fastest"),
    (dict(options={"no_such_option": 1}), "torch.compile refused these settings.*no_such_option"),
    (dict(dynamic="yes"), "dynamic must be None, True or False"),
    (dict(fullgraph=1), "fullgraph must be True or False"),
])
def test_compile_refuses_bad_settings_before_any_step(settings, message):
    model = _compile_case("encoder-decoder", "token", "materialized").float()
    with pytest.raises(ValueError, match=message):
        model.compile(**settings)
    assert not model.compiled  # refused settings leave the model eager


def test_kept_logits_refuse_a_deferred_weight_gradient_and_a_non_bool():
    from rag_fast.models._seq2seq import DeferredHeadGrad

    h = torch.randn(B * K, T, 8)
    weight = torch.randn(37, 8, requires_grad=True)
    scores = torch.randn(B, K)
    targets = torch.randint(0, 37, (B, T))
    with pytest.raises(ValueError, match="cannot also be deferred"):
        rag_fast.linear_rag_nll(h, weight, scores, targets, n_docs=K, keep_logits=True,
                                deferred_weight_grad=DeferredHeadGrad())
    with pytest.raises(ValueError, match="keep_logits must be True or False"):
        rag_fast.linear_rag_nll(h, weight, scores, targets, n_docs=K, keep_logits="yes")


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_a_compiled_model_is_unchanged(kind):
    """generate() stays eager: the same token ids as the model before compile(), and nothing
    is compiled by decoding."""
    model = _compile_case(kind, "token", "materialized").float()
    contexts, mask, scores, _ = _case_batch(kind)
    want = model.generate(context_input_ids=contexts, context_attention_mask=mask,
                          doc_scores=scores.float(), num_beams=2, max_new_tokens=5).sequences
    model.compile(backend="aot_eager")
    got = model.generate(context_input_ids=contexts, context_attention_mask=mask,
                         doc_scores=scores.float(), num_beams=2, max_new_tokens=5).sequences
    assert torch.equal(got, want) and model._compiled == {}


def test_rag_fast_marks_constant_results_as_torch_compiler_does():
    """rag_fast.ops.backend marks its two constant functions itself, so that importing it does
    not import torch._dynamo (1.2 s of every command's start-up): the mark must be the one
    ``torch.compiler.assume_constant_result`` makes."""
    from rag_fast.ops import backend

    def theirs():
        return True

    def ours():
        return True

    torch.compiler.assume_constant_result(theirs)
    backend._constant_result(ours)
    assert vars(theirs) == vars(ours) and vars(ours)
    assert vars(backend._ext_available) == vars(ours) == vars(backend._triton_usable)


def test_the_command_starts_without_torch_dynamo():
    """Start-up: importing the command imports neither torch._dynamo nor the compiler stack."""
    from utils import run_python

    done = run_python(["-c", "import sys, rag_fast.cli; print(sorted(m for m in sys.modules if "
                             "m.startswith(('torch._dynamo', 'torch._inductor'))))"], check=True)
    assert done.stdout.strip() == "[]", done.stdout
