"""The pieces of a Hugging Face seq2seq generator that RagModel drives itself.

RagModel never asks the generator for its logits: it runs the encoder and the decoder, then
applies the LM head (weight, bias and output scale, read here once per architecture) to the
decoder states of the positions that have a target, and hands those logits to a fused RAG loss
that writes their gradient in place. ``transformers`` keeps the logits, their log-softmax and
the marginalisation's temporaries alive at once; this path keeps one logits-sized buffer.

When the LM head shares its weight with the input embeddings (BART, T5, ... tie them), a training
step would otherwise build that ``[V, d]`` gradient three times: the LM head's, plus one dense
zero-filled ``[V, d]`` tensor per embedding lookup (encoder and decoder), summed out of place.
:func:`split_tied_weight` gives the lookups their own alias of the weight with sparse
gradients and adds their rows into the LM head's gradient in place: one ``[V, d]`` tensor. That
tensor is made at the end of the backward pass, once the activations are freed, not at its start
(:class:`DeferredHeadGrad`), so it no longer sits on top of them at the step's memory peak.

Supported: every ``*ForConditionalGeneration`` with ``get_encoder``/``get_decoder``/
``get_output_embeddings`` whose logits are ``scale * h @ W^T + bias`` (BART, mBART, Pegasus,
Marian, T5, mT5, ...). ``lm_logits`` is checked against the generator's own forward in the tests.
"""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from rag_fast import _pool
from rag_fast.generation.heads import LMHead, check_decoder_parts, decoder_parts, head_logits

def check_seq2seq(generator: nn.Module) -> None:
    """Raise ValueError unless ``generator`` is a seq2seq LM RagModel can drive."""
    for name in ("get_encoder", "get_decoder", "get_output_embeddings"):
        if not callable(getattr(generator, name, None)):
            raise ValueError(
                f"generator must be a Hugging Face seq2seq LM (BART, T5, ...) with {name}(); "
                f"got {type(generator).__name__}"
            )
    if not getattr(getattr(generator, "config", None), "is_encoder_decoder", False):
        raise ValueError(f"generator {type(generator).__name__} is not an encoder-decoder model")
    if generator.get_encoder() is generator:  # a decoder-only model whose config says otherwise
        raise ValueError(f"generator {type(generator).__name__} has no encoder of its own, but "
                         "its config says is_encoder_decoder=True (an edited config?)")
    head = generator.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"generator's output embeddings must be nn.Linear, got {type(head).__name__}")
    check_decoder_parts(generator)  # a composite's decoder, read as states, transform and head


def vocab_size(generator: nn.Module) -> int:
    return int(generator.get_output_embeddings().weight.shape[0])


class DeferredHeadGrad:
    """The LM head's weight gradient ``g^T h``, computed late.

    The LM head's backward runs first in a backward pass, while every activation of the
    generator is still alive; a ``[V, d]`` weight gradient made there would sit on top of all of
    them, at the step's memory peak. The chunked LM head (:class:`_LMHeadLogits`) instead hands
    its ``(g, h)`` here, and the tied weight's backward (:class:`TiedWeightFunction`), which runs
    last, after the embedding lookups' backward, when the activations are freed, computes the
    product. ``g`` is the logits' gradient, which the fused loss wrote into the logits' own
    buffer: holding it costs nothing more.
    """

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._late: list = []

    def add(self, g: torch.Tensor, h: torch.Tensor) -> None:
        self._parts.append((g, h))

    def add_late(self, weight_grad) -> None:
        """A callable returning a ``[V, d]`` gradient, called in :meth:`take` (the fused LM-head
        loss hands its tile-by-tile ``G^T h`` here)."""
        self._late.append(weight_grad)

    def take(self) -> torch.Tensor | None:
        """``sum g^T h`` over what was added, plus the late parts (None if nothing was
        added), forgetting it."""
        parts, self._parts = self._parts, []
        late, self._late = self._late, []
        out = None
        for g, h in parts:
            if out is None:  # a [V, d] gradient: the pool's reused memory (see _pool.py)
                out = torch.mm(g.t(), h, out=_pool.empty((g.shape[1], h.shape[1]), g.dtype, like=h))
            else:
                out.addmm_(g.t(), h)
        for weight_grad in late:
            part = weight_grad()
            out = part if out is None else out.add_(part)
        return out


class TiedWeightFunction(torch.autograd.Function):
    """Two aliases ``(head, embed)`` of one ``[V, d]`` weight.

    Backward: ``g_head`` (the LM head's dense gradient, a temporary no one else holds, plus
    what ``deferred`` holds) plus ``g_embed`` (the embedding lookups' gradients, sparse rows),
    added in place into ``g_head``.
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor, deferred: DeferredHeadGrad | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # a missing gradient stays None, not a [V, d] zero
        ctx.deferred = deferred
        return weight.view_as(weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx, g_head: torch.Tensor | None, g_embed: torch.Tensor | None):
        late = ctx.deferred.take() if ctx.deferred is not None else None
        if late is not None:
            g_head = late if g_head is None else late.add_(g_head)
        if g_embed is None:
            return g_head, None
        if g_head is None:
            return (g_embed.to_dense() if g_embed.is_sparse else g_embed), None
        if not g_head.is_contiguous():
            g_head = g_head.contiguous()
        if g_embed.is_sparse:  # uncoalesced rows: index_add_ sums repeated tokens
            g_head.index_add_(0, g_embed._indices()[0], g_embed._values().to(g_head.dtype))
        else:
            g_head.add_(g_embed)
        return g_head, None


@dataclass(frozen=True)
class TiedWeight:
    """The LM head's weight split for one forward: ``head`` for the LM head, ``embed`` for the
    input embedding ``modules`` that share ``weight`` (see :func:`split_tied_weight`)."""

    weight: torch.Tensor
    head: torch.Tensor
    embed: torch.Tensor
    modules: tuple[nn.Embedding, ...]
    deferred: DeferredHeadGrad


def split_tied_weight(generator: nn.Module) -> TiedWeight | None:
    """Aliases of the LM head's weight for a training forward, or None when the weight is not
    tied to an input embedding, needs no gradient, or an embedding renormalises it (max_norm),
    and under ``torch.compile``."""
    weight = generator.get_output_embeddings().weight
    # Compiled graphs cannot carry sparse gradients; the compiler plans the dense ones' memory.
    if not (torch.is_grad_enabled() and weight.requires_grad) or torch.compiler.is_compiling():
        return None
    modules = tuple(m for m in generator.modules()
                    if isinstance(m, nn.Embedding) and m.weight is weight)
    if not modules or any(m.max_norm is not None for m in modules):
        return None
    deferred = DeferredHeadGrad()
    head, embed = TiedWeightFunction.apply(weight, deferred)
    return TiedWeight(weight, head, embed, modules, deferred)


@contextmanager
def _sparse_gradients(modules: tuple[nn.Embedding, ...]) -> Iterator[None]:
    saved = [m.sparse for m in modules]
    for m in modules:
        m.sparse = True
    try:
        yield
    finally:
        for m, sparse in zip(modules, saved):
            m.sparse = sparse


def call_with_tied(module: nn.Module, tied: TiedWeight | None, **kwargs):
    """``module(**kwargs)``; with ``tied``, its lookups of the tied weight read ``tied.embed``
    and give sparse gradients (restored when the call returns)."""
    names = [] if tied is None else [
        n for n, p in module.named_parameters(remove_duplicate=False) if p is tied.weight]
    if not names:
        return module(**kwargs)
    with _sparse_gradients(tied.modules):
        return torch.func.functional_call(module, {n: tied.embed for n in names}, kwargs=kwargs)


def encode(
    generator: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    tied: TiedWeight | None = None,
):
    """Encoder states ``[N, L, d]`` of the contexts ``[N, L]``, as the decoder reads them (a
    composite's projection applied, :func:`rag_fast.generation.heads.decoder_parts`)."""
    out = call_with_tied(generator.get_encoder(), tied, input_ids=input_ids,
                         attention_mask=attention_mask, return_dict=True)
    project = decoder_parts(generator).project
    return out.last_hidden_state if project is None else project(out.last_hidden_state)


def decode(
    generator: nn.Module,
    decoder_input_ids: torch.Tensor,
    encoder_states: torch.Tensor,
    encoder_mask: torch.Tensor,
    tied: TiedWeight | None = None,
) -> torch.Tensor:
    """Decoder states ``[N, T, d]`` (before the LM head's scale): what the LM head's Linear
    reads (a composite's head transform applied: see
    :func:`rag_fast.generation.heads.decoder_parts`)."""
    parts = decoder_parts(generator)
    out = call_with_tied(
        parts.body,
        tied,
        input_ids=decoder_input_ids,
        encoder_hidden_states=encoder_states,
        encoder_attention_mask=encoder_mask,
        use_cache=False,
        return_dict=True,
    )
    states = out.last_hidden_state
    return states if parts.transform is None else parts.transform(states)


# Vocabulary columns per matmul in the CPU training path: a [512, d] slice of the LM head stays
# in L2 while it meets every decoder state. Whether one [N, d] x [d, V] call is slower depends
# on the machine's cache and BLAS (measured: docs/tuning.md, "Training: LM_HEAD_CHUNK").
LM_HEAD_CHUNK = 512


class LogitsWorkspace:
    """A logits buffer that successive training steps reuse.

    A training step's logits (``[B*K, T, V]`` fp32, the largest tensor of the step) die after its
    backward. Allocating them afresh costs a page fault per 4 KiB page every step (tensors this
    large bypass the allocator's free lists); the workspace keeps the buffer instead. It is handed
    out only when no one else holds it: a forward whose logits (or their graph) are still alive
    when the next forward asks gets a new buffer, so nothing is ever overwritten while in use.
    Not saved with the model; a copy of the model starts with an empty workspace.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None
        self._idle_uses = 0

    # How many references a storage has; without it (another torch) nothing is ever reused.
    _use_count = getattr(torch._C, "_storage_Use_Count", None)

    @classmethod
    def _uses(cls, t: torch.Tensor) -> int:
        return cls._use_count(t.untyped_storage()._cdata)

    def claim(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` over the buffer (uninitialised), or over a new one. The buffer
        grows to the largest step seen; :meth:`release` gives it back."""
        n = math.prod(shape)
        if self._use_count is None:
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            buf = self._buf
            if (buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device
                    or self._uses(buf) != self._idle_uses):
                buf = torch.empty(n, dtype=dtype, device=device)
                self._buf, self._idle_uses = buf, self._uses(buf)
            return buf[:n].view(shape)

    def release(self) -> None:
        """Drop the buffer (its memory returns once no one else holds it)."""
        with self._lock:
            self._buf = None

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


class _LMHeadLogits(torch.autograd.Function):
    """``h @ weight^T + bias`` into a workspace buffer, ``LM_HEAD_CHUNK`` columns per matmul.
    h ``[N, d]``, weight ``[V, d]``, bias ``[V]`` or None -> ``[N, V]``. With ``deferred``, the
    weight's gradient is left to it (see :class:`DeferredHeadGrad`)."""

    @staticmethod
    def forward(ctx, h, weight, bias, workspace: LogitsWorkspace,
                deferred: DeferredHeadGrad | None = None):
        V = weight.shape[0]
        out = workspace.claim((h.shape[0], V), h.dtype, h.device)
        for start in range(0, V, LM_HEAD_CHUNK):
            stop = min(start + LM_HEAD_CHUNK, V)
            torch.mm(h, weight[start:stop].t(), out=out[:, start:stop])
        if bias is not None:
            out += bias
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        ctx.deferred = deferred
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        h, weight = ctx.saved_tensors
        g = g.contiguous()
        g_h = g @ weight if ctx.needs_input_grad[0] else None
        g_w = None
        if ctx.needs_input_grad[1]:
            if ctx.deferred is not None:
                ctx.deferred.add(g, h)  # computed by the tied weight's backward, at the end
            else:
                g_w = g.t() @ h
        g_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return g_h, g_w, g_b, None, None


def lm_logits(
    head: LMHead, states: torch.Tensor, workspace: LogitsWorkspace | None = None,
    deferred: DeferredHeadGrad | None = None,
) -> torch.Tensor:
    """``[..., V]`` logits of decoder states ``[..., d]`` (autocast applies to the matmul).

    With a ``workspace``, fp32 CPU training (grad enabled, no autocast) writes the logits into
    the workspace's buffer, ``LM_HEAD_CHUNK`` vocabulary columns per matmul; same values and
    gradients as ``nn.functional.linear``. ``deferred``: the split tied weight's
    (:func:`split_tied_weight`), which then computes the weight's gradient at the end of the
    backward pass. Under ``torch.compile`` the compiler plans memory
    itself and the workspace is not used.
    """
    h = states * head.scale if head.scale != 1.0 else states
    if (workspace is not None and not torch.compiler.is_compiling()
            and torch.is_grad_enabled() and h.device.type == "cpu"
            and h.dtype == torch.float32 and head.weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")):
        lead = h.shape[:-1]
        out = _LMHeadLogits.apply(h.reshape(-1, h.shape[-1]), head.weight, head.bias, workspace,
                                  deferred)
        return out.view(*lead, out.shape[-1])
    return head_logits(head, states)
