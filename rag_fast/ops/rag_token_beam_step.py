"""The fused RAG-Token beam step: the best next (score, beam, token) of every question.

For question b, beam j, passage k and token v (docs/design.md, "RAG-Token beam step"):

    M[b,j,v] = logsumexp_k (a[b,k] + x[b,j,k,v] - logsumexp_v' x[b,j,k,v'])
    c[b,j,v] = (M[b,j,v] + bias[b*W+j, v]) + beam_score[b,j]

and the step returns the ``n`` (default ``2W``) best ``(j, v)`` of each question, sorted by
score descending, equal scores broken by the lower flat index ``j*V + v`` first. This is what
``transformers`` computes every beam-search step of ``RagTokenForGeneration`` with a
log_softmax over ``[B*W*K, V]``, a logsumexp over K, another log_softmax, an addition and a
top-k over ``[B, W*V]``; the fused step never materializes any ``[B, W, K, V]`` or
``[B, W, V]`` float tensor.

Trade-off: the C++ kernel reads the logits twice (row normalisers, then the marginal with a
running top-n that skips a vector of tokens after its K maxima when it cannot beat the n-th
best); the Triton kernel reads them twice and writes ``[B*W, V]`` float32 scores, then a
stable sort selects. No autograd: decoding only. Both run as the custom op

    beam_step(Tensor logits, Tensor log_prior, Tensor beam_scores, Tensor? bias,
              int num_candidates, str impl="auto") -> (Tensor scores, Tensor beams, Tensor tokens)

registered here (CPU and CUDA implementations and a fake one; the backend is
:func:`rag_fast.ops.backend.choose`'s rule: C++ for CPU tensors, Triton for CUDA ones). Its
kernels: ``csrc/beam_step.cpp`` and the Triton module ``rag_fast.kernels.beam_step``; the
reference: ``rag_fast.reference_decoding.rag_token_beam_step``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rag_fast import _ext, reference_decoding
from rag_fast.ops import _boundary, backend
from rag_fast.ops.backend import resolve_impl


def _check(
    logits: torch.Tensor,
    log_prior: torch.Tensor,
    beam_scores: torch.Tensor,
    bias: torch.Tensor | None,
    num_candidates: int | None,
) -> int:
    for name, t in (("logits", logits), ("log_prior", log_prior), ("beam_scores", beam_scores)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating torch.Tensor")
    if logits.dim() != 4:
        raise ValueError(f"logits must have shape [B, W, K, V], got {tuple(logits.shape)}")
    B, W, K, V = logits.shape
    if min(B, W, K, V) < 1:
        raise ValueError(f"logits [B, W, K, V] must have every size >= 1, got {tuple(logits.shape)}")
    if tuple(log_prior.shape) != (B, K):
        raise ValueError(f"log_prior must have shape [B, K] = [{B}, {K}], got {tuple(log_prior.shape)}")
    if tuple(beam_scores.shape) != (B, W):
        raise ValueError(
            f"beam_scores must have shape [B, W] = [{B}, {W}], got {tuple(beam_scores.shape)}"
        )
    tensors = [log_prior, beam_scores]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise ValueError("bias must be a floating torch.Tensor or None")
        if tuple(bias.shape) != (B * W, V):
            raise ValueError(f"bias must have shape [B*W, V] = [{B * W}, {V}], got {tuple(bias.shape)}")
        tensors.append(bias)
    for t in tensors:
        if t.device != logits.device:
            raise ValueError(f"every input must be on the logits' device {logits.device}")
    n = 2 * W if num_candidates is None else num_candidates
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_candidates must be a positive int, got {num_candidates!r}")
    return min(n, W * V)


def rag_token_beam_step(
    logits: torch.Tensor,
    log_prior: torch.Tensor,
    beam_scores: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_candidates: int | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One RAG-Token beam-search step: the best candidates of each question.

    Args:
        logits: ``[B, W, K, V]`` generator logits of the step (question, beam, passage, token);
            float32 or bfloat16 for the kernels (float64 runs the reference). Finite.
        log_prior: ``[B, K]`` passage log-priors ``log_softmax(doc_scores)``; ``-inf`` marks a
            missing passage (weight 0).
        beam_scores: ``[B, W]`` running beam scores (log-probabilities).
        bias: ``[B*W, V]`` additive bias applied to the marginal before the beam score (e.g.
            ``-inf`` on EOS below the minimum length), or None.
        num_candidates: candidates per question, default ``2W``; clipped to ``W*V``.
        impl: ``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"`` (the reference).

    Returns:
        ``(scores, beams, tokens)``, each ``[B, n]`` with ``n = min(num_candidates, W*V)``:
        float32 scores (float64 under "torch" for float64 logits) sorted descending, ties by the
        lower flat index ``beam*V + token`` first; int64 beam and token indices.

    Raises:
        ValueError: bad ranks or shapes, non-floating inputs, tensors on different devices,
            a non-positive ``num_candidates``, an impl that cannot run here.
    """
    n = _check(logits, log_prior, beam_scores, bias, num_candidates)
    resolved = resolve_impl(impl, logits)
    if resolved == "torch":
        return reference_decoding.rag_token_beam_step(logits, log_prior, beam_scores, bias, n)
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    b = None if bias is None else bias.detach()
    return torch.ops.rag_fast.beam_step(x.detach(), log_prior.detach(), beam_scores.detach(), b,
                                        n, resolved)


# ---- the custom op torch.ops.rag_fast.beam_step ----------------------------------------------


def _check_beam_step(logits, log_prior, beam_scores, bias, num_candidates, impl) -> str:
    chosen = _boundary.check("beam_step", impl, logits, lambda B, W, K, V: {
        "log_prior": (log_prior, (B, K), _boundary.FLOAT),
        "beam_scores": (beam_scores, (B, W), _boundary.FLOAT),
        "bias": (bias, (B * W, V), _boundary.FLOAT),
    }, dims="[B, W, K, V]")
    _, W, _, V = logits.shape
    if not 1 <= num_candidates <= W * V:
        raise ValueError(f"rag_fast::beam_step: num_candidates must lie in [1, W*V = {W * V}], "
                         f"got {num_candidates}")
    return chosen


@torch.library.custom_op(
    "rag_fast::beam_step", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor log_prior, Tensor beam_scores, Tensor? bias, "
           "int num_candidates, str impl=\"auto\") -> (Tensor, Tensor, Tensor)",
)
def beam_step(logits: Tensor, log_prior: Tensor, beam_scores: Tensor, bias: Tensor | None,
              num_candidates: int, impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    chosen = _check_beam_step(logits, log_prior, beam_scores, bias, num_candidates, impl)
    a, beam = log_prior.float().contiguous(), beam_scores.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    _boundary.check_memory("beam_step", chosen, {"logits": logits})
    if chosen == "cpp":
        return cpp.beam_step(logits, a, beam, b, num_candidates)
    # deferred: Triton is an optional dependency
    from rag_fast.kernels import beam_step as triton_beam_step

    return triton_beam_step.beam_step(logits, a, beam, b, num_candidates)


@beam_step.register_fake
def _(logits, log_prior, beam_scores, bias, num_candidates, impl="auto"):
    _check_beam_step(logits, log_prior, beam_scores, bias, num_candidates, impl)
    B, n = logits.shape[0], num_candidates
    return (logits.new_empty((B, n), dtype=torch.float32),
            logits.new_empty((B, n), dtype=torch.int64),
            logits.new_empty((B, n), dtype=torch.int64))


# ---- the C++ launcher ---------------------------------------------------------------------


class cpp:  # a namespace: the launcher, named as the Triton module's
    """The C++ launcher of ``csrc/beam_step.cpp``, on CPU tensors the custom op has checked."""

    @staticmethod
    def beam_step(x: Tensor, a: Tensor, beam: Tensor, bias: Tensor | None, n: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """x ``[B, W, K, V]``; a ``[B, K]``, beam ``[B, W]``, bias ``[B*W, V]`` or None:
        float32, contiguous -> the top ``n`` (scores float32, beams int64, tokens int64), each
        ``[B, n]``."""
        B = x.shape[0]
        scores = torch.empty((B, n), dtype=torch.float32)
        beams = torch.empty((B, n), dtype=torch.int64)
        tokens = torch.empty((B, n), dtype=torch.int64)
        _ext.get().rag_token_beam_step(
            *backend.logits_view(x), a.data_ptr(), beam.data_ptr(),
            0 if bias is None else bias.data_ptr(), n,
            scores.data_ptr(), beams.data_ptr(), tokens.data_ptr(),
        )
        return scores, beams, tokens
