"""Lean activations (rag_fast/models/_lean.py): tensors saved for the backward stored by recipe
give bit-identical losses and gradients, for every generator family RagModel drives."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rag_fast.models import RagModel, _lean
from rag_fast.testing import tiny_hf_rag

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 1


def _bart():
    return tiny_hf_rag("token", n_docs=3, vocab_size=60, layers=2).rag.generator


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    # gated GELU (Flan-T5) with dropout: activation, T5LayerNorm and dropout recipes
    return T5ForConditionalGeneration(T5Config(
        vocab_size=60, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        feed_forward_proj="gated-gelu", dropout_rate=0.1, pad_token_id=PAD, eos_token_id=2,
        decoder_start_token_id=PAD))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=PAD, bos_token_id=0, eos_token_id=2))


GENERATORS = {"bart": _bart, "t5": _t5, "qwen2": _qwen2}


def _batch(B=2, K=3, L=7, T=5, V=60):
    g = torch.Generator().manual_seed(3)
    contexts = torch.randint(3, V, (B * K, L), generator=g)
    mask = torch.ones_like(contexts)
    mask[1, :2] = 0  # one shorter context
    labels = torch.randint(3, V, (B, T), generator=g)
    labels[0, -1] = PAD
    scores = torch.randn(B, K, generator=g)
    return contexts, mask, labels, scores


def _run(model, batch, lean_context: bool, autocast: bool = False):
    """Loss, doc-score gradient and every generator gradient of one training step; dropout
    masks from one fixed seed (``autocast``: the forward under bf16 autocast, the backward
    outside it)."""
    contexts, mask, labels, scores = batch
    model.train()
    model.generator.zero_grad(set_to_none=True)
    s = scores.clone().requires_grad_()
    torch.manual_seed(1234)
    registry = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if lean_context:
            with _lean.lean_activations() as registry:
                loss = model.loss_from_contexts(contexts, mask, s, labels)
        else:
            loss = model.loss_from_contexts(contexts, mask, s, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.generator.named_parameters()
             if p.grad is not None}
    return loss.detach(), s.grad.clone(), grads, registry


def _assert_identical(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and a[2]
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


@pytest.mark.parametrize("family", sorted(GENERATORS))
@pytest.mark.parametrize("mode,path", [("token", "materialized"), ("sequence", "fused")])
def test_bit_identical_gradients(family, mode, path, monkeypatch):
    monkeypatch.setattr(_lean, "MIN_MASK_ELEMENTS", 64)  # tiny models have tiny masks
    gen = GENERATORS[family]()
    plain = RagModel(gen, mode=mode, n_docs=3, lm_head_loss=path, lean_activations=False)
    batch = _batch()
    reference = _run(plain, batch, lean_context=False)
    _lean.prepare(gen)
    lean = _run(plain, batch, lean_context=True)
    _assert_identical(reference, lean)
    registry = lean[3]
    assert registry.recipes > 0 and registry.bytes_saved > 0
    # BART and T5 train with dropout: its CPU masks are stored one byte per element
    assert (registry.masks > 0) == (family != "qwen2")
    # and through RagModel's own switch (the default)
    default = RagModel(gen, mode=mode, n_docs=3, lm_head_loss=path)
    assert default.lean_activations is True
    _assert_identical(reference, _run(default, batch, lean_context=False))


def test_cross_attention_projections_are_recomputed(monkeypatch):
    """The keys and values every decoder layer projects from the encoder's output are stored
    by recipe (RagModel names that output with share_input): two [B*K, L, d] tensors per
    decoder layer fewer, the same gradients bit for bit. (BART's attention, SDPA, saves the
    projections themselves; T5's saves copies in another layout, which stay as they are: the
    bit-identity test above covers it.)"""
    gen = GENERATORS["bart"]()
    model = RagModel(gen, n_docs=3, lm_head_loss="materialized", lean_activations=False)
    batch = _batch()
    reference = _run(model, batch, lean_context=False)
    _lean.prepare(gen)
    shared = _run(model, batch, lean_context=True)
    monkeypatch.setattr(_lean, "share_input", lambda t: None)
    alone = _run(model, batch, lean_context=True)
    _assert_identical(reference, shared)
    _assert_identical(reference, alone)
    layers, d = gen.config.decoder_layers, gen.config.d_model
    B, K, L = 2, 3, 7
    assert shared[3].recipes - alone[3].recipes >= 2 * layers
    assert shared[3].bytes_saved - alone[3].bytes_saved == 2 * layers * B * K * L * d * 4


def test_share_input_only_for_the_tensor_named():
    """Only projections of the named tensor, as it was named, are stored by recipe; the
    gradients stay identical; an in-place change of it before the backward is an error."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def forward(lean: bool):
        enc = x * 2.0
        with _lean.lean_activations(lean) as registry:
            _lean.share_input(enc)
            a = lin(enc).relu()  # relu saves its output, not the projection
            counts = [registry.recipes if lean else 0]
            b = lin(enc) * x  # the product saves the projection: by recipe
            counts.append(registry.recipes if lean else 0)
            c = lin(x * 3.0) * x  # another tensor's projection: kept
            counts.append(registry.recipes if lean else 0)
        return enc, a.sum() + b.sum() + c.sum(), counts

    lin.zero_grad()
    x.grad = None
    _, loss, _ = forward(False)
    loss.backward()
    expected = [lin.weight.grad.clone(), lin.bias.grad.clone(), x.grad.clone()]
    _lean.prepare(lin)
    lin.zero_grad()
    x.grad = None
    _, loss, counts = forward(True)
    assert counts == [0, 1, 1]
    loss.backward()
    for a, b in zip(expected, [lin.weight.grad, lin.bias.grad, x.grad]):
        assert torch.equal(a, b)

    enc, loss, _ = forward(True)
    with torch.no_grad():
        enc.add_(1.0)  # the projection's input, after the forward pass
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()
    with _lean.lean_activations() as registry:
        _lean.share_input(enc)
        with torch.no_grad():
            enc.add_(1.0)  # changed after it was named: its projections are kept
        y = lin(enc) * x
        assert registry.recipes == 0
    y.sum().backward()


def test_projection_saved_through_a_view():
    """A projection reshaped into heads (its own output object gone, as in an attention block)
    is stored by recipe and gives the same gradients; changed in place through the view before
    it is saved, it is kept as it is; the named input, itself a norm's output, is taken from
    the norm's recipe and not kept alive."""
    torch.manual_seed(0)
    norm, lin = nn.LayerNorm(8), nn.Linear(8, 8)
    x = torch.randn(2, 3, 8, requires_grad=True)

    def forward(change: bool):
        h = norm(x * 2.0)
        _lean.share_input(h)
        k = lin(h).view(2, 3, 2, 4).transpose(1, 2)  # the Linear's output object dies here
        if change:
            with torch.no_grad():
                k.mul_(2.0)
        return k.pow(2).sum()  # pow saves a view of the projection

    def grads(loss):
        for p in (x, norm.weight, norm.bias, lin.weight, lin.bias):
            p.grad = None
        loss.backward()
        return [p.grad.clone() for p in (x, norm.weight, norm.bias, lin.weight, lin.bias)]

    for change in (False, True):
        expected = grads(forward(change))
        _lean.prepare(norm)
        _lean.prepare(lin)
        with _lean.lean_activations() as registry:
            loss = forward(change)
            projections = [e for e in registry._outputs.values() if e.projection]
        # unchanged: the projection (its view saved by pow) by recipe, and its
        # recomputation reads h through the norm's recipe; changed: kept as it is
        assert registry.recipes == (0 if change else 1) + 1  # + h, saved by the Linear
        assert len(projections) == 1
        assert projections[0].out() is None  # matched through the storage, not the object
        source = projections[0].source
        if change:
            assert source is None and projections[0].stale
        else:
            assert source.x is None and source.x_saved is not None
        for a, b in zip(expected, grads(loss)):
            assert torch.equal(a, b)


def test_projection_of_a_linear_subclass_is_kept():
    """Only a plain nn.Linear is recomputed: a subclass's forward may keep state."""

    class Counting(nn.Linear):
        calls = 0

        def forward(self, x):
            Counting.calls += 1
            return super().forward(x)

    lin = Counting(8, 8)
    _lean.prepare(lin)
    x = torch.randn(4, 8, requires_grad=True)
    with _lean.lean_activations() as registry:
        enc = x * 2.0
        _lean.share_input(enc)
        y = lin(enc) * x
    assert registry.recipes == 0
    y.sum().backward()
    assert Counting.calls == 1


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.5),
                         nn.Linear(16, 8))


def test_what_is_stored_by_recipe(monkeypatch):
    monkeypatch.setattr(_lean, "MIN_MASK_ELEMENTS", 64)
    model = _mlp().train()
    assert _lean.prepare(model) == 2  # the LayerNorm and the GELU
    x = torch.randn(64, 8, requires_grad=True)
    torch.manual_seed(0)
    ref = model(x * 1.0)
    ref.sum().backward()
    expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    torch.manual_seed(0)
    with _lean.lean_activations() as registry:
        out = model(x * 1.0)
    # the LayerNorm's output (saved by the first Linear) and the dropout mask; the GELU's output
    # is not saved (the second Linear saves the dropout's output, the product keeps the mask)
    assert registry.recipes == 1 and registry.masks == 1
    out.sum().backward()
    assert torch.equal(out, ref)
    got = [p.grad for p in model.parameters()] + [x.grad]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_input_modified_in_place_is_an_error():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    _lean.prepare(model)
    x = torch.randn(4, 8, requires_grad=True)
    with _lean.lean_activations() as registry:
        h = model[0](x)
        y = model[2](model[1](h))
    assert registry.recipes == 1  # the GELU output, saved by the last Linear
    with torch.no_grad():
        h.add_(1.0)  # the GELU's input, after the forward pass
    with pytest.raises(RuntimeError, match="modified"):
        y.sum().backward()


def test_inactive_where_it_must_not_change_anything():
    with torch.no_grad(), _lean.lean_activations() as registry:
        assert registry is None
    with _lean.lean_activations(enabled=False) as registry:
        assert registry is None
    # another saved-tensor hook context (e.g. offloading to the CPU) keeps its tensors
    with torch.autograd.graph.save_on_cpu(), _lean.lean_activations() as registry:
        assert registry is None
    with _lean.lean_activations() as outer, _lean.lean_activations() as inner:
        assert outer is not None and inner is None


@pytest.mark.parametrize("extension", [True, False])
def test_masks_are_exact_or_left_alone(extension, monkeypatch):
    """One bit per element through the C++ extension, one byte (torch ops) without it: the same
    decisions and the same tensors back, bit for bit."""
    from rag_fast import _ext

    assert _ext.available()  # the test machine has the extension built
    if not extension:
        monkeypatch.setattr(_ext, "available", lambda: False)
    g = torch.Generator().manual_seed(0)
    noise = torch.empty(100, 64).bernoulli_(0.9, generator=g).div_(0.9)
    mask = _lean._as_mask(noise)
    assert mask is not None
    if extension:
        assert mask.bits.dtype == torch.uint8 and mask.nbytes == 100 * 64 // 8
    else:
        assert mask.nonzero.dtype == torch.bool and mask.nbytes == 100 * 64
    assert torch.equal(mask(), noise)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        other = noise.to(dtype)
        back = _lean._as_mask(other)()
        assert back.dtype == dtype and torch.equal(back.view(bits[dtype]),
                                                   other.view(bits[dtype]))
    # sizes that are no multiple of 8, or span several of the kernel's 64 Ki-element chunks
    for shape in ((3, 7), (1, 1), (2, 65537), (5, 3, 4099)):
        other = torch.empty(shape).bernoulli_(0.5, generator=g).mul_(3.0)
        other.view(-1)[0] = 3.0  # the cheap first check reads the positive value at the start
        back = _lean._as_mask(other)()
        assert back.shape == other.shape and torch.equal(back.view(torch.int32),
                                                         other.view(torch.int32))
        if other.numel() > 256:  # a third value in the last, partial byte
            other.view(-1)[-1] = 0.5
            assert _lean._as_mask(other) is None
    assert _lean._as_mask(torch.zeros(100, 64)) is None  # no positive value
    three = noise.clone()
    three[-1, -1] = 0.5  # a third value, after the cheap first check
    assert _lean._as_mask(three) is None
    negative_zero = noise.clone()
    negative_zero[-1, -1] = -0.0
    assert _lean._as_mask(negative_zero) is None
    infinite = noise.clone()
    infinite.fill_(float("inf"))
    assert _lean._as_mask(infinite) is None


def test_bad_option():
    with pytest.raises(ValueError, match="lean_activations"):
        RagModel(_bart(), n_docs=3, lean_activations="yes")


def test_with_gradient_checkpointing():
    """The checkpointed layers keep their own saved-tensor mechanism; the result is unchanged."""
    gen = _bart()
    gen.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain = RagModel(gen, n_docs=3, lm_head_loss="materialized", lean_activations=False)
    lean = RagModel(gen, n_docs=3, lm_head_loss="materialized")
    batch = _batch()
    _assert_identical(_run(plain, batch, lean_context=False), _run(lean, batch, lean_context=False))


def test_gated_product_is_recomputed():
    """A SwiGLU feed-forward (Llama, Qwen2): the linear layer after ``act(gate) * up`` saves
    the product by recipe, and the gradients stay identical."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    mlp = _qwen2().model.layers[0].mlp
    assert isinstance(mlp, Qwen2MLP)
    _lean.prepare(mlp)
    x = torch.randn(3, 5, 32, requires_grad=True)
    ref = mlp(x)
    ref.sum().backward()
    expected = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]
    mlp.zero_grad()
    x.grad = None
    with _lean.lean_activations() as registry:
        out = mlp(x)
    # SiLU's output (saved by the product) and the product (saved by down_proj)
    assert registry.recipes == 2
    assert registry.bytes_saved == 2 * 3 * 5 * 64 * 4
    out.sum().backward()
    assert torch.equal(out, ref)
    for a, b in zip(expected, [p.grad for p in mlp.parameters()] + [x.grad]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["bart", "qwen2"])
def test_under_bf16_autocast(family):
    """Recomputed in the backward under the forward's autocast setting (bf16 training), with
    the backward itself outside autocast as usual."""
    gen = GENERATORS[family]()
    plain = RagModel(gen, n_docs=3, lm_head_loss="materialized", lean_activations=False)
    lean = RagModel(gen, n_docs=3, lm_head_loss="materialized")
    batch = _batch()
    _assert_identical(_run(plain, batch, False, autocast=True),
                      _run(lean, batch, False, autocast=True))


def test_tensors_kept_as_they_are_keep_autograd_version_check():
    """A tensor saved as it is and then modified in place still fails the backward, as it does
    without the hooks (autograd leaves that check to whoever packs saved tensors)."""
    w = torch.randn(5, requires_grad=True)
    with _lean.lean_activations():
        a = torch.randn(5, requires_grad=True) * 1.0
        y = (a * w).sum()  # saves a and w
    with torch.no_grad():
        a.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def _mlp_grads(run, lean: bool):
    """Gradients of ``run(modules)`` (a scalar) over a SwiGLU-style block, with or without the
    lean context."""
    torch.manual_seed(0)
    gate, up, down, act = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 4), nn.SiLU()
    block = nn.ModuleList([gate, up, down, act])
    _lean.prepare(block)
    x = torch.randn(3, 6)
    if lean:
        with _lean.lean_activations():
            y = run(x, gate, up, down, act)
    else:
        y = run(x, gate, up, down, act)
    y.backward()
    return [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("case", ["factor changed before the product",
                                  "input changed after the module ran"])
def test_in_place_changes_in_the_forward_are_not_recomputed_away(case):
    """Values changed in place during the forward (under no_grad) are what autograd saw; a
    recipe that recomputed the original would differ, so none is used."""
    def run(x, gate, up, down, act):
        u = gate(x)
        g = act(u)
        with torch.no_grad():
            (g if case.startswith("factor") else u).mul_(2.0)
        return down(g * up(x)).sum()

    if case.startswith("input"):
        # the activation's own backward fails on its changed input; the weight gradient of
        # the layers after it does not need it and must match autograd
        def run_grad(lean):
            torch.manual_seed(0)
            gate, up, down, act = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 4), nn.SiLU()
            _lean.prepare(nn.ModuleList([gate, up, down, act]))
            x = torch.randn(3, 6)
            with _lean.lean_activations(enabled=lean):
                y = run(x, gate, up, down, act)
            return torch.autograd.grad(y, down.weight)[0]

        assert torch.equal(run_grad(False), run_grad(True))
        return
    for a, b in zip(_mlp_grads(run, False), _mlp_grads(run, True)):
        assert torch.equal(a, b)


def test_inactive_under_torch_func():
    def f(w):
        with _lean.lean_activations() as registry:
            assert registry is None  # torch.func transforms refuse saved-tensor hooks
            return (nn.functional.gelu(w) * w).sum()

    torch.func.grad(f)(torch.randn(5))
