"""A model directory opened to answer questions: its retriever attached, on its device.

``rag-fast eval`` and ``rag-fast generate`` open their model here; the errors name the
options those commands spell (``--model``, ``--index``, ``--n-docs``, ``--max-new-tokens``).
"""
from __future__ import annotations

import os

import torch

from rag_fast._validation import generator_positions
from rag_fast.models.build import check_n_docs
from rag_fast.models.rag_model import RagModel
from rag_fast.models.retriever_io import (check_same_encoder, load_retriever,
                                          read_bundle_manifest)

# The decoding a question gets when it names none: `rag-fast eval`, `generate` and `serve` alike.
from rag_fast._defaults import DEFAULT_BEAMS, DEFAULT_NEW_TOKENS


def load_for_inference(model_dir: str, index: str | None, device: torch.device | str,
                       require_index: bool = True, n_docs: int | None = None,
                       retrieval_mode: str = "dense") -> RagModel:
    """The model directory ``model_dir`` with its retriever (over ``index``, else the index the
    model records; none when it records none and ``require_index`` is False), moved to
    ``device`` in eval mode.

    ``n_docs`` (``--n-docs``) replaces the model's passages per question, retrieved and
    marginalised over (None: the model's own). ``retrieval_mode``: the retriever's ``dense``,
    ``bm25``, ``hybrid`` or ``weighted`` (``--retrieval-mode``; all but dense need the index's
    BM25 part).

    Raises:
        ValueError: ``require_index`` and no index given or recorded; ``n_docs`` below 1 or
            above the index's passage count (naming ``--n-docs``).
        FileNotFoundError: the index directory does not exist.
    """
    if n_docs is not None:
        if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1:
            raise ValueError(f"--n-docs must be an integer >= 1, got {n_docs!r}")
        if index is not None:  # before the model loads
            check_n_docs(n_docs, index, name="--n-docs")
    model = RagModel.load(model_dir, **({} if n_docs is None else {"n_docs": n_docs}))
    recorded = model.index_path
    if index is not None and recorded and os.path.isdir(recorded) \
            and os.path.realpath(index) != os.path.realpath(recorded):
        _check_encoder_of(index, recorded)
    index = index or model.index_path
    if index is None:
        if require_index:
            raise ValueError(f"--model {model_dir!r} records no index directory: pass --index DIR")
        if retrieval_mode != "dense":
            raise ValueError(f"--retrieval-mode {retrieval_mode}: --model {model_dir!r} records "
                             "no index directory to search: pass --index DIR")
    else:
        if not os.path.isdir(index):
            raise FileNotFoundError(f"index directory {index!r} does not exist (the model "
                                    "records it; pass --index DIR if it moved)")
        if n_docs is not None:
            check_n_docs(n_docs, index, name="--n-docs")
        model.retriever = load_retriever(index, n_docs=model.n_docs, n_docs_from=(
            "--n-docs" if n_docs is not None else f"the model {model_dir!r}"),
            mode=retrieval_mode, mode_flag="--retrieval-mode")
        model.index_path = index
    return model.to(device).eval()


def _check_encoder_of(index: str, recorded: str) -> None:
    """``--index`` must record the encoder of the index the model records (when that one is
    there and readable): questions are encoded with the model's question encoder."""
    try:
        expected = (read_bundle_manifest(recorded) or {}).get("encoder")
    except (OSError, ValueError):  # the recorded index is unreadable: --index replaces it
        return
    if os.path.isdir(index):
        found = (read_bundle_manifest(index) or {}).get("encoder")
        check_same_encoder(expected, found, index,
                           f"the index the model records ({recorded!r})")


def check_new_tokens(model, max_new_tokens: int, flag: str = "--max-new-tokens") -> None:
    """Refuse more new tokens than the generator has positions (with a decoder-only one, the
    prompt's longest context included), before decoding allocates for them."""
    config = getattr(getattr(model, "generator", None), "config", None)
    positions = None if config is None else generator_positions(config, "answer")
    if positions is None:
        return  # relative positions (T5): no fixed bound
    room = positions - model.family.prompt_positions(model.max_context_length)
    if room < 1:
        raise ValueError(f"the model's prompts (max_context_length {model.max_context_length}) "
                         f"fill all {positions} positions of its generator: no room for an "
                         "answer; make the model again with a smaller --max-context-length")
    if max_new_tokens > room:
        raise ValueError(f"{flag} {max_new_tokens} is more than the generator can place "
                         f"({positions} positions" + (f", {model.max_context_length} of them the "
                                                      "prompt" if room != positions else "")
                         + f"); use at most {room}")


__all__ = ["DEFAULT_BEAMS", "DEFAULT_NEW_TOKENS", "check_new_tokens", "load_for_inference"]
