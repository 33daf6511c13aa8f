"""Where ``inplace_grad=True`` may write the logits' gradient: never into a leaf that requires
grad, a view of one, or memory shared with one (an optimizer step or a second loss would read
the gradient as the leaf's values). The public losses check the logits they are given; the
statistics ops, which do the write, check again and also compare storages."""
from __future__ import annotations

import torch
from torch import Tensor


def check_inplace_grad(op: str, logits: torch.Tensor, inplace_grad: bool) -> None:
    """Refuse ``inplace_grad=True`` (ValueError naming ``rag_fast.<op>``) for the logits a public
    loss was given when they are a leaf that requires grad or a view of one (any layout, any
    chain of views), whichever impl then runs: the reference writes nothing, but it refuses
    the same logits, so a call does not pass on one machine and fail on another. The
    statistics ops, which do the write, check again and also compare storages
    (:func:`inplace_grad_refusal`). Nothing is checked where no backward will run
    (grad disabled, logits that do not require grad) or under ``torch.compile``, where
    ``inplace_grad`` is ignored."""
    if (inplace_grad and isinstance(logits, torch.Tensor) and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):
        check_inplace_grad_target(f"rag_fast.{op}", logits, True, storage=False)


def storage_ptr(t: Tensor) -> int:
    """The address of ``t``'s storage; 0 where it has none to compare (fake, meta, or a
    tensor subclass without one)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def leaf_sharing_storage(logits: Tensor) -> Tensor | None:
    """A leaf that requires grad and whose storage is the logits' storage, found among the
    leaves of the logits' autograd graph (its AccumulateGrad nodes); None if there is none.
    This catches aliases autograd does not record as views (``aten._unsafe_view``, a custom
    ``autograd.Function`` that returns its input's memory under a new tensor). One visit per
    node of the graph (its cost: docs/tuning.md, "The inplace_grad leaf search")."""
    ptr = storage_ptr(logits)
    if not ptr or logits.grad_fn is None:
        return None
    seen: set = set()
    stack = [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates
        if variable is not None:
            if variable.requires_grad and storage_ptr(variable) == ptr:
                return variable
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return None


def inplace_grad_refusal(logits: Tensor, storage: bool = True) -> str | None:
    """The leaf whose values ``inplace_grad=True`` would overwrite with the logits' gradient
    (a phrase for an error message), or None if the logits' storage may take it.

    Refused, when the logits require grad: logits that are themselves a leaf; a view, through
    any chain of views (reshape, view, slice, transpose, expand, as_strided, the
    ``[B*K, T, V]`` -> ``[B, K, T, V]`` split), of a leaf that requires grad (autograd's
    ``_base``); and (``storage``) logits whose storage is that of a leaf that requires grad
    in their autograd graph. Writing there would replace the leaf's values (a parameter, the
    user's input) by its gradient. Logits that do not require grad are never written (no
    backward computes their gradient), and a view of a buffer that does not require grad
    (RagModel's logits workspace) is not a leaf's memory in this sense."""
    if not logits.requires_grad:
        return None
    if logits.is_leaf:
        return "the leaf tensor logits"
    base = logits
    while base._base is not None:  # torch keeps the root here; followed in case it does not
        base = base._base
    if base is not logits and base.is_leaf and base.requires_grad:
        return f"the leaf tensor (shape {list(base.shape)}) that the logits are a view of"
    if storage and not torch.compiler.is_compiling():
        leaf = leaf_sharing_storage(logits)
        if leaf is not None:
            return f"the leaf tensor (shape {list(leaf.shape)}) whose storage the logits share"
    return None


def check_inplace_grad_target(where: str, logits: Tensor, inplace_grad: bool,
                              storage: bool = True) -> None:
    """Raise ValueError, naming ``where``, when ``inplace_grad`` would write the logits'
    gradient into a leaf's storage (:func:`inplace_grad_refusal`)."""
    if not inplace_grad:
        return
    why = inplace_grad_refusal(logits, storage)
    if why is None:
        return
    raise ValueError(
        f"{where}: inplace_grad=True would overwrite {why} with its own gradient (the "
        "values an optimizer step or a second loss reads would be lost): pass "
        "inplace_grad=False for a leaf, a view of one or memory shared with one, or use "
        "inplace_grad=True only for logits an op computed (e.g. logits = lm_head(h))"
    )


__all__ = ["check_inplace_grad", "check_inplace_grad_target", "inplace_grad_refusal",
           "leaf_sharing_storage", "storage_ptr"]
