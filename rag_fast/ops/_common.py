"""Shared pieces of the RAG loss ops: input preparation and target masks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rag_fast._validation import check_epsilon, check_loss_inputs, check_reduction
from rag_fast.ops._dispatch import resolve_impl


@dataclass(frozen=True)
class PreparedLoss:
    impl: str
    logits: torch.Tensor  # [B, K, T, V], stride 1 along V for kernel impls
    doc_scores: torch.Tensor  # [B, K]
    targets: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] bool: real target positions
    nll_mask: torch.Tensor  # [B, T] bool: positions counted in the NLL term
    ignore_index: int


def prepare_loss(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    n_docs: int | None,
    epsilon: float,
    ignore_index: int,
    exclude_bos: bool,
    reduction: str,
    impl: str,
) -> PreparedLoss:
    """Validate the arguments of a RAG loss and pick its impl (raises ValueError)."""
    check_epsilon(epsilon)
    check_reduction(reduction)
    # Target values are read on the host for CPU tensors; on a GPU that would synchronise, and
    # under torch.compile it would break the graph, so there an out-of-range target is an
    # asynchronous assertion instead (the CPU kernels' op boundary checks them again).
    host_check = logits.device.type == "cpu" and not torch.compiler.is_compiling()
    inp = check_loss_inputs(logits, doc_scores, targets, n_docs, ignore_index, host_check)
    targets = inp.targets.contiguous()
    if not host_check and not logits.is_meta:  # meta tensors have no values to check
        V = inp.logits.shape[-1]
        torch._assert_async(
            ((targets == ignore_index) | ((targets >= 0) & (targets < V))).all(),
            "targets must lie in [0, V) or equal ignore_index",
        )
    resolved = resolve_impl(impl, inp.logits)
    x = inp.logits
    if resolved != "torch" and x.stride(-1) != 1:
        x = x.contiguous()  # the kernels need a contiguous vocabulary axis
    mask = targets != ignore_index
    nll_mask = mask.clone()
    if exclude_bos and nll_mask.shape[1] > 0:
        nll_mask[:, 0] = False
    return PreparedLoss(resolved, x, inp.doc_scores, targets, mask, nll_mask, ignore_index)
