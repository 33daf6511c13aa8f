"""RagModel: a question encoder, a retriever and a seq2seq generator trained jointly (paper sec. 2).

Forward, for B questions and K passages each:

    q[b]        = question_encoder(question[b])                  [B, d]   (gradient)
    z[b, :], e  = retriever(q.detach(), K)                       passages, embeddings [B, K, d]
    s[b, k]     = q[b] . e[b, k]   (-inf for a missing passage)  [B, K]   (gradient to q only)
    x[b, k]     = generator(title / text // question, labels)    [B*K, T-1, V]
    loss        = rag_token_nll | rag_sequence_nll (x, s, labels shifted left)

The passage encoder and the index stay fixed (no gradient through the index). Targets follow
``transformers``' RAG models: ``labels`` ``[B, T]`` are the decoder input as given, the loss
target at position t is ``labels[t + 1]`` and padding (``pad_token_id`` or -100) is ignored, so
the loss equals ``RagTokenForGeneration`` / ``RagSequenceForGeneration`` with the same weights.
The decoder runs on ``labels[:, :-1]`` only: the last position's target is always padding.

The LM head is applied by this module (see ``_seq2seq``) and the fused loss writes the logits'
gradient into the logits' own buffer, so a training step holds one logits-sized tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rag_fast import _pool, _threads
from rag_fast._stages import StageClock
from rag_fast._validation import check_decoding_scores, generator_positions
from rag_fast.generation import heads
from rag_fast.models import _lean, _seq2seq
from rag_fast.models.checkpoint import (load_model_dir, model_from_transformers, rag_config,
                                        save_rag_model)
from rag_fast.models.contexts import (Retrieved, RetrieverLike, decode_answers,
                                      from_retrieved_passages, join_context, passage_fields)
from rag_fast.models.family import family_of
from rag_fast.models.options import check_arguments, is_int, lm_head_path
from rag_fast.ops import linear_rag_nll, rag_sequence_nll, rag_token_nll

@dataclass
class RagOutput:
    """loss: reduced loss (``[B]`` for reduction "none"); doc_scores ``[B, K]``;
    passages: the passages used (None when contexts were passed in)."""

    loss: torch.Tensor
    doc_scores: torch.Tensor
    passages: list[list[Any]] | None = None


class RagModel(nn.Module):
    """RAG-Token or RAG-Sequence over any Hugging Face seq2seq or decoder-only generator and
    question encoder.

    Args:
        generator: a ``*ForConditionalGeneration`` model (BART, T5, ...), or a decoder-only
            ``*ForCausalLM`` (Llama, Qwen2, Mistral, GPT-2, ...; its config needs a
            ``pad_token_id``). For a decoder-only generator the prompt is the passage and the
            question, ``labels`` are the answer tokens and answers come back without the
            prompt: see docs/decoder_only.md.
        question_encoder: a module mapping ``(input_ids [B, L], attention_mask [B, L])`` to
            ``[B, d]`` vectors, or to hidden states ``[B, L, d]`` pooled by ``question_pooling``
            (DPR question encoders return ``[B, d]`` already). May be None when questions are
            never encoded here (contexts and doc_scores passed to ``forward``).
        retriever: an object with ``retrieve(q [B, d], n_docs=K)`` returning :class:`Retrieved`
            or a ``rag_fast.retrieval`` RetrievedPassages (e.g. a ``rag_fast.retrieval``
            Retriever); may be None when passages are passed in.
        mode: "token" (paper eq. 2) or "sequence" (eq. 1).
        n_docs: K, passages per question.
        generator_tokenizer / question_tokenizer: Hugging Face tokenizers, needed when
            questions or passages are given as text.
        epsilon: label smoothing; exclude_bos: RAG-Sequence's ``exclude_bos_score``.
        question_pooling: "auto" | "cls" | "mean" for encoders returning hidden states.
        normalize_questions: L2-normalise question vectors (for cosine-trained encoders).
        max_context_length: generator context tokens (truncated).
        loss_impl: the loss kernels' backend, ``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"``.
        lm_head_loss: how the LM head meets the loss. ``"fused"``: one op that computes the
            logits a vocabulary tile at a time and never holds all of them
            (``rag_fast.linear_rag_nll``; one or two more LM-head GEMMs per step);
            ``"materialized"``: the ``[B*K, T, V]`` logits in a reused buffer, then the fused
            loss over them (faster while they fit); ``"auto"`` (default): fused once a step's
            logits would take at least :data:`FUSED_LOGITS_BYTES` (1 GiB), else materialized.
            Both paths trace under ``torch.compile`` (see :meth:`compile`).
        lean_activations: store the generator's activation outputs, gated products (SwiGLU),
            normalisation outputs, cross-attention keys and values and (on the CPU) dropout
            masks for the backward by recipe (recomputed from tensors the backward keeps
            anyway, or one bit per mask element) instead of as tensors: the same gradients bit
            for bit, about 45% less activation memory for BART-family generators, a few
            elementwise passes and the cross-attention's key/value projections again in the
            backward (see ``rag_fast/models/_lean.py``). Default True.

    Raises:
        ValueError: naming the argument, before any model work: a mode, question_pooling,
            lm_head_loss or loss_impl outside its choices; n_docs not an int >= 1;
            max_context_length or max_question_length not an int >= 1 (bools, floats and
            strings are refused, not converted); epsilon not a number (not a bool) in
            ``[0, 1]``, the loss ops' rule; exclude_bos, normalize_questions or
            lean_activations not a bool; bos_token_id neither None nor an int >= 0. Also a
            generator RagModel cannot drive, or a generator tokenizer with more tokens than
            the generator's vocabulary.
    """

    def __init__(
        self,
        generator: nn.Module,
        question_encoder: nn.Module | None = None,
        retriever: RetrieverLike | None = None,
        *,
        mode: str = "token",
        n_docs: int = 5,
        generator_tokenizer: Any = None,
        question_tokenizer: Any = None,
        epsilon: float = 0.0,
        exclude_bos: bool = False,
        bos_token_id: int | None = None,
        question_pooling: str = "auto",
        normalize_questions: bool = False,
        max_context_length: int = 128,
        max_question_length: int = 64,
        loss_impl: str = "auto",
        lm_head_loss: str = "auto",
        lean_activations: bool = True,
    ) -> None:
        super().__init__()
        _pool.limit_bytes()  # the buffer pool's RAG_FAST_POOL_MB, before any model work
        _threads.threads_from_env()  # and RAG_FAST_THREADS (applied at import when valid)
        check_arguments(mode=mode, n_docs=n_docs, question_pooling=question_pooling,
                        lm_head_loss=lm_head_loss, loss_impl=loss_impl,
                        max_context_length=max_context_length,
                        max_question_length=max_question_length, epsilon=epsilon,
                        exclude_bos=exclude_bos, normalize_questions=normalize_questions,
                        lean_activations=lean_activations, bos_token_id=bos_token_id)
        # encoder-decoder or decoder-only (any *ForCausalLM): decided once, here (family.py)
        self.family = family_of(generator)
        self.family.check(generator)
        V = _seq2seq.vocab_size(generator)
        if generator_tokenizer is not None and len(generator_tokenizer) > V:
            raise ValueError(
                f"generator_tokenizer has {len(generator_tokenizer)} tokens but the "
                f"generator's vocabulary has {V}: token ids would fall outside the LM head; "
                "use the generator's own tokenizer or resize its embeddings"
            )
        pad = generator.config.pad_token_id
        if pad is None:
            raise ValueError("generator.config.pad_token_id must be set (it marks padding)")
        self.generator = generator
        self.question_encoder = question_encoder
        self.retriever = retriever
        self.mode = mode
        self.n_docs = int(n_docs)
        self.generator_tokenizer = generator_tokenizer
        self.question_tokenizer = question_tokenizer
        self.epsilon = float(epsilon)
        self.exclude_bos = exclude_bos
        if bos_token_id is None:  # the generator config's, if it is an id (T5: none)
            bos_token_id = getattr(generator.config, "bos_token_id", None)
            bos_token_id = bos_token_id if is_int(bos_token_id) and bos_token_id >= 0 else None
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self.pad_token_id = int(pad)
        self.question_pooling = question_pooling
        self.normalize_questions = normalize_questions
        self.max_context_length = int(max_context_length)  # a numpy int as Python's
        self.max_question_length = int(max_question_length)
        self.loss_impl = loss_impl
        self.lm_head_loss = lm_head_loss
        self.lean_activations = lean_activations
        if lean_activations:
            _lean.prepare(generator)
        # training steps reuse one logits buffer (see _seq2seq.LogitsWorkspace)
        self._logits_workspace = _seq2seq.LogitsWorkspace()
        # the index directory recorded in a saved model (``rag-fast eval/generate`` default)
        self.index_path: str | None = None
        # generation defaults (a transformers GenerationConfig) of a loaded model directory
        self.generation_config: Any = None
        # torch.compile options of compile(), and the compiled callables (never saved)
        self._compile_options: dict | None = None
        self._compiled: dict = {}

    def compile(self, *, dynamic: bool | None = None, mode: str | None = None,
                backend: str = "inductor", options: dict | None = None,
                fullgraph: bool = False) -> "RagModel":
        """Run this model's training computation under ``torch.compile`` from now on, and
        return the model.

        Two regions are compiled, each into one graph (when the generator's own code allows):
        the question encoder with its pooling (:meth:`encode_questions`) and the generator with
        the RAG loss (:meth:`loss_from_contexts`, which :meth:`forward` calls). rag_fast's ops
        are inside the graphs as custom ops (the fused RAG losses, the fused LM-head loss and
        its gradient pass) that the compiler does not break on; retrieval, tokenisation and
        :meth:`generate` stay eager. Compiled, the materialized path's logits buffer is not
        reused and a tied LM head's gradient is not deferred (the compiler plans memory
        itself), and ``lean_activations`` keeps tensors as eager autograd would.

        Args (passed to ``torch.compile``): ``dynamic`` (None: a length seen a second time
        with another value is compiled once more as a dynamic dimension, then no more; see
        docs/tuning.md, "Compiled training"), ``mode``, ``backend``, ``options``,
        ``fullgraph``.
        Compiling happens at the first call of each region (about a minute on two cores for a
        BART-base-sized generator); later calls with new lengths reuse the dynamic graph.

        Raises:
            ValueError: ``dynamic`` or ``fullgraph`` of the wrong type, or settings
                ``torch.compile`` refuses (an unknown backend, mode or option), before any
                compiling.
        """
        if dynamic is not None and not isinstance(dynamic, bool):
            raise ValueError(f"dynamic must be None, True or False, got {dynamic!r}")
        if not isinstance(fullgraph, bool):
            raise ValueError(f"fullgraph must be True or False, got {fullgraph!r}")
        settings = dict(dynamic=dynamic, mode=mode, backend=backend, options=options,
                        fullgraph=fullgraph)
        try:  # torch checks the backend, mode and options here; nothing is traced yet
            torch.compile(self._loss_with_activations, **settings)
        except (RuntimeError, ValueError, TypeError, AssertionError) as e:
            raise ValueError(f"RagModel.compile: torch.compile refused these settings: "
                             f"{e}") from e
        self._compile_options = settings
        self._compiled = {}
        return self

    @property
    def compiled(self) -> bool:
        """Whether :meth:`compile` was called."""
        return self._compile_options is not None

    def _compiled_region(self, name: str):
        """The compiled version of region ``name`` (``"encode"`` or ``"loss"``), or None when
        the model is not compiled or the caller is already being traced."""
        if self._compile_options is None or torch.compiler.is_compiling():
            return None
        fn = self._compiled.get(name)
        if fn is None:
            eager = {"encode": self._encode_questions, "loss": self._loss_with_activations}[name]
            fn = self._compiled[name] = torch.compile(eager, **self._compile_options)
        return fn

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_compiled"] = {}  # compiled code belongs to one instance; rebuilt on first use
        return state

    def release_buffers(self) -> None:
        """Free the logits buffer that training steps reuse (it is rebuilt by the next step)."""
        self._logits_workspace.release()

    # ----------------------------------------------------------------------------- config
    def options(self) -> dict:
        """The constructor options that define this model (saved with checkpoints)."""
        return {
            "mode": self.mode, "n_docs": self.n_docs, "epsilon": self.epsilon,
            "exclude_bos": self.exclude_bos, "bos_token_id": self.bos_token_id,
            "question_pooling": self.question_pooling,
            "normalize_questions": self.normalize_questions,
            "max_context_length": self.max_context_length,
            "max_question_length": self.max_question_length, "loss_impl": self.loss_impl,
            "lm_head_loss": self.lm_head_loss, "lean_activations": self.lean_activations,
        }

    @property
    def vocab_size(self) -> int:
        return _seq2seq.vocab_size(self.generator)

    @property
    def device(self) -> torch.device:
        return next(self.generator.parameters()).device

    @property
    def decoder_start_token_id(self) -> int | None:
        """The first decoder token of every answer, as :meth:`generate` starts it (the
        generation config's ``decoder_start_token_id``, else its BOS, else the generator
        config's); training labels start with it too (``rag_fast.training.encode_targets``).
        None for a decoder-only generator, whose answers continue the prompt."""
        return self.family.decoder_start_token_id(self)

    @property
    def is_causal(self) -> bool:
        """Whether the generator is decoder-only (its family: ``self.family``)."""
        return self.family.decoder_only

    def transformers_view(self) -> "_TransformersView":
        """What ``rag_fast.generation``'s searches read from a ``transformers`` RAG model."""
        return _TransformersView(self)

    @property
    def max_positions(self) -> int | None:
        """The longest context the generator's position embeddings allow (None: no limit)."""
        return generator_positions(self.generator.config, "context")

    def context_length(self) -> int:
        """Tokens a context is truncated to: ``max_context_length``, at most the generator's
        positions (a longer context would index past its position embeddings)."""
        limit = self.max_positions
        return self.max_context_length if limit is None else min(self.max_context_length, limit)

    # ----------------------------------------------------------------------- questions
    def tokenize_questions(self, questions: Sequence[str]) -> dict:
        if self.question_tokenizer is None:
            raise ValueError("questions given as text need question_tokenizer=")
        device = self.generator.device
        enc = self.question_tokenizer(list(questions), padding=True, truncation=True,
                                      max_length=self.max_question_length, return_tensors="pt")
        return {"input_ids": enc["input_ids"].to(device),
                "attention_mask": enc["attention_mask"].to(device)}

    def encode_questions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Question vectors ``[B, d]`` (with gradient) from token ids ``[B, L]``."""
        if self.question_encoder is None:
            raise ValueError("this RagModel has no question_encoder")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        compiled = self._compiled_region("encode")
        if compiled is not None:
            return compiled(input_ids, attention_mask)
        return self._encode_questions(input_ids, attention_mask)

    def _encode_questions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.question_encoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden = out if isinstance(out, torch.Tensor) else out[0]
        if hidden.dim() == 3:  # [B, L, d] hidden states: pool
            if self.question_pooling == "cls":
                hidden = hidden[:, 0]
            else:
                m = attention_mask.to(hidden.dtype).unsqueeze(-1)
                hidden = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        elif hidden.dim() != 2:
            raise ValueError(f"question_encoder output must be [B, d] or [B, L, d], got "
                             f"{tuple(hidden.shape)}")
        if self.normalize_questions:
            hidden = nn.functional.normalize(hidden, dim=-1)
        return hidden

    # ----------------------------------------------------------------------- retrieval
    def retrieve(self, question_embeddings: torch.Tensor,
                 questions: Sequence[str] | None = None) -> Retrieved:
        """K passages per question from the retriever (no gradient through the index);
        ``questions``: their texts, which a retriever in a mode other than ``dense`` searches."""
        if self.retriever is None:
            raise ValueError("this RagModel has no retriever: pass passages= and "
                             "passage_embeddings=, or contexts and doc_scores, to forward()")
        with torch.no_grad():
            if getattr(self.retriever, "mode", "dense") != "dense":
                found = self.retriever.retrieve(question_embeddings.detach(),
                                                questions=questions, n_docs=self.n_docs)
            else:
                found = self.retriever.retrieve(question_embeddings.detach(),
                                                n_docs=self.n_docs)
        if isinstance(found, Retrieved):
            return found
        return from_retrieved_passages(self.retriever, found)

    def score_passages(
        self, question_embeddings: torch.Tensor, passages: Sequence[Sequence[Any]],
        passage_embeddings: torch.Tensor,
    ) -> torch.Tensor:
        """``s[b, k] = q[b] . e[b, k]`` ``[B, K]``, ``-inf`` past each question's passages.

        Raises:
            ValueError: batch sizes that differ, more than K passages, a question with none.
        """
        B, K = question_embeddings.shape[0], self.n_docs
        if len(passages) != B:
            raise ValueError(f"retrieved passages are for {len(passages)} questions but the "
                             f"question batch has {B}")
        if passage_embeddings.dim() != 3 or passage_embeddings.shape[0] != B:
            raise ValueError(f"passage_embeddings must be [B={B}, K, d], got "
                             f"{tuple(passage_embeddings.shape)}")
        if passage_embeddings.shape[-1] != question_embeddings.shape[-1]:
            raise ValueError(f"passage embeddings have dimension {passage_embeddings.shape[-1]} "
                             f"but question embeddings {question_embeddings.shape[-1]}")
        counts = [len(p) for p in passages]
        for b, n in enumerate(counts):
            if n == 0:
                raise ValueError(f"question {b} has no retrieved passage")
            if n > K or n > passage_embeddings.shape[1]:
                raise ValueError(f"question {b} has {n} passages, more than n_docs={K} or "
                                 f"than passage_embeddings provides ({passage_embeddings.shape[1]})")
        e = passage_embeddings[:, :K].to(question_embeddings)
        if e.shape[1] < K:  # pad to K rows; the padding is masked below
            e = torch.cat([e, e.new_zeros(B, K - e.shape[1], e.shape[2])], dim=1)
        scores = torch.bmm(question_embeddings.unsqueeze(1), e.transpose(1, 2)).squeeze(1)
        missing = torch.arange(K, device=scores.device)[None, :] >= torch.tensor(
            counts, device=scores.device)[:, None]
        return scores.masked_fill(missing, float("-inf"))

    def build_contexts(self, questions: Sequence[str], passages: Sequence[Sequence[Any]]) -> dict:
        """Tokenised generator inputs ``[B*K, L]`` (a missing passage: the question alone)."""
        if self.generator_tokenizer is None:
            raise ValueError("passages given as text need generator_tokenizer=")
        if len(questions) != len(passages):
            raise ValueError(f"{len(questions)} questions but passages for {len(passages)}")
        texts = []
        for question, found in zip(questions, passages):
            for k in range(self.n_docs):
                if k < len(found):
                    texts.append(join_context(*passage_fields(found[k]), question))
                else:
                    texts.append(question)
        tok = self.generator_tokenizer
        # the family's side (a decoder-only prompt is left-padded, so the answer follows its
        # last token in the same column for every row, and cut on the left: the question ends it)
        saved = (tok.padding_side, tok.truncation_side)
        tok.padding_side = tok.truncation_side = self.family.padding_side
        try:
            enc = tok(texts, padding=True, truncation=True, max_length=self.context_length(),
                      return_tensors="pt")
        finally:
            tok.padding_side, tok.truncation_side = saved
        device = self.generator.device
        return {"input_ids": enc["input_ids"].to(device),
                "attention_mask": enc["attention_mask"].to(device)}

    # -------------------------------------------------------------------------- forward
    def forward(
        self,
        labels: torch.Tensor,
        *,
        questions: Sequence[str] | None = None,
        question_input_ids: torch.Tensor | None = None,
        question_attention_mask: torch.Tensor | None = None,
        passages: Sequence[Sequence[Any]] | None = None,
        passage_embeddings: torch.Tensor | None = None,
        context_input_ids: torch.Tensor | None = None,
        context_attention_mask: torch.Tensor | None = None,
        doc_scores: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> RagOutput:
        """The RAG loss of ``labels`` ``[B, T]`` (decoder input; target = labels shifted left;
        for a decoder-only generator: the answer tokens, target t = ``labels[:, t]``, predicted
        from the token before it, see docs/decoder_only.md).

        Passage scores: ``doc_scores`` ``[B, K]`` if given (as ``transformers``' RAG models
        accept), else ``q . e`` from the questions (``questions`` as text, or
        ``question_input_ids``) and ``passage_embeddings`` ``[B, K, d]`` (with ``passages``, or
        from the retriever). Contexts: ``context_input_ids`` ``[B*K, L]`` +
        ``context_attention_mask`` if given, else built from the question and passage texts.

        Raises:
            ValueError: missing inputs, batch sizes that differ, labels out of the vocabulary.
        """
        inputs = self._resolve_inputs(questions, question_input_ids, question_attention_mask,
                                      passages, passage_embeddings, context_input_ids,
                                      context_attention_mask, doc_scores)
        doc_scores, passages = inputs.doc_scores, inputs.passages
        context_input_ids, context_attention_mask = inputs.context_input_ids, inputs.context_mask
        loss = self.loss_from_contexts(context_input_ids, context_attention_mask, doc_scores,
                                       labels, reduction)
        return RagOutput(loss, doc_scores, passages)

    def _resolve_inputs(self, questions, question_input_ids, question_attention_mask, passages,
                        passage_embeddings, context_input_ids, context_attention_mask,
                        doc_scores, clock: StageClock | None = None) -> "_Inputs":
        """Passage scores ``[B, K]`` and contexts ``[B*K, L]`` from whatever was given (see
        :meth:`forward`): retrieving, scoring and tokenising only what is missing (each stage
        it runs told to ``clock``)."""
        clock = clock or StageClock(None)
        if doc_scores is None:
            if question_input_ids is None:
                if not questions:
                    raise ValueError("give questions (text or question_input_ids) or doc_scores")
                q_inputs = self.tokenize_questions(questions)
                question_input_ids, question_attention_mask = (q_inputs["input_ids"],
                                                               q_inputs["attention_mask"])
            elif questions is None and context_input_ids is None:
                if self.question_tokenizer is None:
                    raise ValueError("question_input_ids without questions or contexts need "
                                     "question_tokenizer= (to write the contexts)")
                questions = [t.strip() for t in self.question_tokenizer.batch_decode(
                    question_input_ids, skip_special_tokens=True)]
            q = self.encode_questions(question_input_ids, question_attention_mask)
            clock.lap("encode")
            if questions is not None and q.shape[0] != len(questions):
                raise ValueError(f"{len(questions)} questions but {q.shape[0]} question encodings")
            if passage_embeddings is None:
                if passages is not None:
                    raise ValueError("passages= needs passage_embeddings= (to score them)")
                found = self.retrieve(q, questions)
                passages, passage_embeddings = found.passages, found.embeddings
            if passages is None:  # pre-tokenised contexts: every question has K passages
                if context_input_ids is None:
                    raise ValueError("passage_embeddings without passages need context_input_ids")
                scored = [[None] * self.n_docs for _ in range(q.shape[0])]
                doc_scores = self.score_passages(q, scored, passage_embeddings)
            else:
                doc_scores = self.score_passages(q, passages, passage_embeddings)
            clock.lap("retrieve")
        if context_input_ids is None:
            if questions is None or passages is None:
                raise ValueError("give context_input_ids, or questions and passages as text")
            ctx = self.build_contexts(questions, passages)
            context_input_ids, context_attention_mask = ctx["input_ids"], ctx["attention_mask"]
            clock.lap("contexts")
        if context_attention_mask is None:
            raise ValueError("context_input_ids needs context_attention_mask")
        kept = None if passages is None else [list(p) for p in passages]
        return _Inputs(doc_scores, context_input_ids, context_attention_mask, kept, questions)

    def count_targets(self, labels: torch.Tensor) -> int:
        """The target tokens the loss of ``labels`` ``[B, T]`` sums over (padding and a seq2seq
        decoder's start token excluded): the loss of a question is the negative log-likelihood
        of its answer summed over these, so ``loss * B / count_targets`` is the loss per
        token."""
        _, targets = self.prepare_labels(labels)
        return int((targets != self.family.ignore_index(self.pad_token_id)).sum())

    def prepare_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(decoder_input_ids [B, T-1], targets [B, T-1])`` from labels ``[B, T]``.

        Decoder-only generators: ``(answer_ids [B, T], targets [B, T])``: the labels are the
        answer tokens themselves, target t predicted from the token before it (the prompt's last
        token for t = 0). ``answer_ids`` have -100 replaced by the pad token; in ``targets``
        every ignored position is -100: -100 itself, and the pad token unless it is also the
        EOS token (then it is the EOS target, and padding must be -100). The generator's
        family decides (``self.family.prepare_labels``).
        """
        return self.family.prepare_labels(labels, self.pad_token_id, self.generator.config)

    def loss_from_contexts(
        self,
        context_input_ids: torch.Tensor,
        context_attention_mask: torch.Tensor,
        doc_scores: torch.Tensor,
        labels: torch.Tensor,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """The RAG loss given contexts ``[B*K, L]``, scores ``[B, K]`` and labels ``[B, T]``."""
        if self.lean_activations:
            _lean.prepare(self.generator)  # modules added since (a no-op for the others)
        compiled = self._compiled_region("loss")
        if compiled is not None:
            return compiled(context_input_ids, context_attention_mask, doc_scores, labels,
                            reduction)
        return self._loss_with_activations(context_input_ids, context_attention_mask,
                                           doc_scores, labels, reduction)

    def _loss_with_activations(self, context_input_ids, context_attention_mask, doc_scores,
                               labels, reduction) -> torch.Tensor:
        B, K = self._check_batch(context_input_ids, doc_scores, labels)
        with _lean.lean_activations(self.lean_activations):
            return self._loss_from_contexts(context_input_ids, context_attention_mask,
                                            doc_scores, labels, reduction, B, K)

    def _loss_from_contexts(self, context_input_ids, context_attention_mask, doc_scores, labels,
                            reduction, B, K) -> torch.Tensor:
        decoder_input_ids, targets = self.prepare_labels(labels)
        head = self.family.lm_head(self.generator)
        # a tied embedding's gradient is added into the LM head's in place (see _seq2seq)
        tied = _seq2seq.split_tied_weight(self.generator)
        if tied is not None:
            head = replace(head, weight=tied.head)
        states = self.family.states(self.generator, context_input_ids, context_attention_mask,
                                    decoder_input_ids, K, tied)  # [B*K, T', d]
        return self._rag_loss(head, tied, states, doc_scores, targets, K, reduction,
                              self.family.ignore_index(self.pad_token_id))

    def _rag_loss(self, head: heads.LMHead, tied, states: torch.Tensor,
                  doc_scores: torch.Tensor, targets: torch.Tensor, K: int,
                  reduction: str, ignore_index: int) -> torch.Tensor:
        """The RAG loss of generator states ``[B*K, T, d]`` (before the LM head's scale) for
        ``targets`` ``[B, T]``: the fused LM-head loss (which never holds the ``[B*K, T, V]``
        logits) or the LM head's logits then a fused loss over them, as ``lm_head_loss`` and
        the logits' size decide (:func:`lm_head_path`)."""
        exclude_bos = False
        if (self.mode == "sequence" and self.exclude_bos and self.bos_token_id is not None
                and self.family.excludes_bos() and targets.shape[1] > 0):
            # transformers' rule: drop BOS only if
            # every target starts with it, decided on the device: no host read, no graph break
            exclude_bos = targets[:, 0].eq(self.bos_token_id).all()
        # Under torch.compile both paths trace without a graph break: they are the custom ops
        # of rag_fast.linear_rag_nll (its statistics and gradient passes).
        device = states.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else head.weight.dtype)
        logits_bytes = states.shape[:-1].numel() * head.weight.shape[0] * dtype.itemsize
        path = lm_head_path(self.lm_head_loss, logits_bytes)
        compiling = torch.compiler.is_compiling()
        if path == "fused" or compiling:
            # compiled, the materialized path is the same op keeping its logits (one graph
            # node for the LM head, the loss and their backward; no logits-sized copies)
            h = states * head.scale if head.scale != 1.0 else states
            return linear_rag_nll(
                h, head.weight, doc_scores, targets, bias=head.bias, mode=self.mode, n_docs=K,
                epsilon=self.epsilon, ignore_index=ignore_index, exclude_bos=exclude_bos,
                reduction=reduction, impl=self.loss_impl,
                deferred_weight_grad=None if tied is None else tied.deferred,
                keep_logits=compiling and path == "materialized")
        logits = _seq2seq.lm_logits(head, states, self._logits_workspace,
                                    None if tied is None else tied.deferred)  # [B*K, T-1, V]
        loss_fn = rag_token_nll if self.mode == "token" else rag_sequence_nll
        return loss_fn(
            logits, doc_scores, targets, n_docs=K, epsilon=self.epsilon,
            ignore_index=ignore_index, exclude_bos=exclude_bos, reduction=reduction,
            impl=self.loss_impl,
            # the logits are a temporary of this function: their buffer takes the gradient (a
            # second backward through this graph then raises instead of reading it)
            inplace_grad=torch.is_grad_enabled(),
        )

    def _check_batch(self, context_input_ids, doc_scores, labels) -> tuple[int, int]:
        if doc_scores.dim() != 2:
            raise ValueError(f"doc_scores must be [B, K], got {tuple(doc_scores.shape)}")
        B, K = doc_scores.shape
        if K != self.n_docs:
            raise ValueError(f"doc_scores has {K} passages per question, n_docs is {self.n_docs}")
        if context_input_ids.dim() != 2 or context_input_ids.shape[0] != B * K:
            raise ValueError(f"context_input_ids must be [B*K, L] = [{B}*{K}, L], got "
                             f"{tuple(context_input_ids.shape)}")
        if labels.dim() != 2 or labels.shape[0] != B:
            raise ValueError(f"labels must be [B={B}, T] (one row per question of doc_scores), "
                             f"got {tuple(labels.shape)}")
        self.family.check_lengths(context_input_ids, labels, self.max_positions)
        V = self.vocab_size
        ok = (labels == -100) | (labels == self.pad_token_id) | ((labels >= 0) & (labels < V))
        if torch.compiler.is_compiling():  # no host read in a compiled graph
            torch._assert_async(ok.all(), "labels contain a token id outside the generator's "
                                          f"vocabulary [0, {V})")
        elif not bool(ok.all()):
            raise ValueError(f"labels contain token id {int(labels[~ok][0])}, outside the "
                             f"generator's vocabulary [0, {V})")
        # a question whose passages are all missing has no passage prior (a NaN loss)
        if doc_scores.device.type == "cpu" and not torch.compiler.is_compiling():
            empty = torch.isneginf(doc_scores.detach()).all(dim=1)
            if bool(empty.any()):
                raise ValueError(
                    f"doc_scores: question {int(empty.nonzero()[0])} has every passage score "
                    "-inf (no passage): each question needs at least one finite passage score")
        return B, K

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        questions: Sequence[str] | None = None,
        *,
        question_input_ids: torch.Tensor | None = None,
        question_attention_mask: torch.Tensor | None = None,
        passages: Sequence[Sequence[Any]] | None = None,
        passage_embeddings: torch.Tensor | None = None,
        context_input_ids: torch.Tensor | None = None,
        context_attention_mask: torch.Tensor | None = None,
        doc_scores: torch.Tensor | None = None,
        decoding: str = "thorough",
        impl: str = "auto",
        on_stage: Callable[[str, float], None] | None = None,
        **settings,
    ) -> "Generation":
        """Answer questions: retrieve with this model's question encoder and retriever, then
        decode RAG-Token or RAG-Sequence (``self.mode``) over ``self.n_docs`` passages.

        Inputs, as for :meth:`forward`: ``questions`` as text (or ``question_input_ids``
        ``[B, L]``, decoded with the question tokenizer for the contexts); optionally the
        passages (with ``passage_embeddings`` ``[B, K, d]``), or ready ``context_input_ids``
        ``[B*K, S]`` with ``doc_scores`` ``[B, K]`` as ``transformers``' RAG ``generate`` takes.

        Args:
            decoding: RAG-Sequence only, ``"thorough"`` or ``"fast"``.
            impl: beam-step backend (``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"``).
            on_stage: called with each stage's name and seconds as it ends (``encode``,
                ``retrieve``, ``contexts``: the ones this call runs; ``decode``: the search and
                the answers' text), see ``rag_fast._stages``.
            **settings: ``num_beams``, ``max_new_tokens`` / ``max_length``, ``min_length``,
                ``length_penalty``, ``num_return_sequences``, ``do_sample``, ``temperature``,
                ``top_k``, ``top_p``, ``repetition_penalty``, ``no_repeat_ngram_size``,
                ``rng`` (a ``torch.Generator`` for the draws) ...; defaults from the model
                directory's ``generation_config.json`` (as ``transformers``). A decoder-only
                generator's repetition penalty and n-gram ban read the prompt too
                (docs/decoder_only.md).
        Returns:
            :class:`Generation`: ``sequences`` ``[B*R, L]`` token ids (R answers per question;
            for a decoder-only generator the answer tokens only, see
            ``rag_fast.generation.causal``), ``texts`` (with a generator tokenizer), the
            passages used and ``doc_scores``.
        Raises:
            ValueError: missing inputs; a question whose passages all score ``-inf`` or a NaN
                score (named); contexts longer than the generator's positions.

        The model is in eval mode while it answers (no dropout) and returns to its mode after.
        """
        was_training = self.training
        self.eval()  # no dropout while answering
        try:
            return self._generate(questions, question_input_ids, question_attention_mask,
                                  passages, passage_embeddings, context_input_ids,
                                  context_attention_mask, doc_scores, decoding, impl, settings,
                                  StageClock(on_stage))
        finally:
            self.train(was_training)

    def _generate(self, questions, question_input_ids, question_attention_mask, passages,
                  passage_embeddings, context_input_ids, context_attention_mask, doc_scores,
                  decoding, impl, settings, clock: StageClock) -> "Generation":
        inputs = self._resolve_inputs(questions, question_input_ids, question_attention_mask,
                                      passages, passage_embeddings, context_input_ids,
                                      context_attention_mask, doc_scores, clock)
        doc_scores, passages, questions = inputs.doc_scores, inputs.passages, inputs.questions
        context_input_ids, context_attention_mask = inputs.context_input_ids, inputs.context_mask
        check_decoding_scores(doc_scores.detach(), questions)
        sequences = self.family.generate(self, context_input_ids, context_attention_mask,
                                         doc_scores, decoding=decoding, impl=impl,
                                         settings=settings)
        texts = None
        if self.generator_tokenizer is not None:
            texts = decode_answers(self.generator_tokenizer, sequences)
        clock.lap("decode")
        return Generation(sequences, texts, passages, doc_scores)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, *, index: str | None = None) -> None:
        """Write a model directory atomically: a ``transformers`` RAG folder (safetensors) plus
        ``rag_fast.json`` (see ``rag_fast.models.checkpoint``); with a decoder-only generator,
        the generator and the question encoder saved side by side (``save_pretrained``) with
        their tokenizers and ``rag_fast.json``. ``index``: the index directory to record
        (default: ``self.index_path``).

        Raises:
            ModelDirError (a ValueError): a generator or question encoder that is not a
                ``transformers`` model.
        """
        save_rag_model(self, path, index=index)

    @classmethod
    def load(cls, path: str, **kwargs) -> "RagModel":
        """Load a model directory (``save``, ``rag-fast init/train``, or a ``transformers`` RAG
        folder; seq2seq or decoder-only generator), verified file by file: ``retriever=``,
        ``device=`` and RagModel option overrides allowed (see
        :func:`rag_fast.models.checkpoint.load_model_dir`)."""
        return load_model_dir(cls, path, **kwargs)

    @classmethod
    def from_transformers(cls, path_or_model: Any, **kwargs) -> "RagModel":
        """A RagModel with the weights and options of a ``transformers`` RAG model or of its
        ``save_pretrained`` directory (``RagTokenForGeneration`` / ``RagSequenceForGeneration``)."""
        return model_from_transformers(cls, path_or_model, **kwargs)

    def replace(self, **changes) -> "RagModel":
        """A RagModel sharing these modules with some options changed (e.g. ``mode``)."""
        retriever = changes.pop("retriever", self.retriever)
        opts = {**self.options(), **changes}
        model = RagModel(self.generator, self.question_encoder, retriever,
                         generator_tokenizer=self.generator_tokenizer,
                         question_tokenizer=self.question_tokenizer, **opts)
        model.index_path, model.generation_config = self.index_path, self.generation_config
        if self._compile_options is not None:
            model.compile(**self._compile_options)
        return model


@dataclass
class _Inputs:
    doc_scores: torch.Tensor  # [B, K]
    context_input_ids: torch.Tensor  # [B*K, L]
    context_mask: torch.Tensor  # [B*K, L]
    passages: list[list[Any]] | None
    questions: Sequence[str] | None


@dataclass
class Generation:
    """What :meth:`RagModel.generate` returns.

    sequences: ``[B*R, L]`` int64 token ids (R = num_return_sequences), starting with the
        decoder start token, padded with the pad token. For a decoder-only generator: the answer
        tokens only (no prompt, no start token), padded with the pad token.
    texts: the decoded answers (None without a generator tokenizer).
    passages: per question, the passages decoded over (None when contexts were given).
    doc_scores: ``[B, K]`` passage scores.
    """

    sequences: torch.Tensor
    texts: list[str] | None
    passages: list[list[Any]] | None
    doc_scores: torch.Tensor


class _TransformersView:
    """What ``rag_fast.generation`` reads from a ``transformers`` RAG model (``rag.generator``,
    ``config``, ``generation_config``), for a RagModel: the same decoding defaults as the
    ``transformers`` model of the same directory."""

    def __init__(self, model: RagModel) -> None:
        from types import SimpleNamespace

        self.rag = SimpleNamespace(generator=model.generator)
        self.config = SimpleNamespace(n_docs=model.n_docs)
        self.generation_config = model.generation_config
        if self.generation_config is None:
            from transformers import GenerationConfig

            try:
                self.generation_config = GenerationConfig.from_model_config(rag_config(model))
            except ValueError:  # no transformers question encoder: the generator's defaults
                self.generation_config = getattr(model.generator, "generation_config", None)


__all__ = ["Generation", "RagModel", "RagOutput"]
