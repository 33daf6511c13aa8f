"""The decoder-only generator adapter (any Hugging Face ``*ForCausalLM``), and
:func:`causal_generate`, RAG-Token and RAG-Sequence decoding through it.

For a decoder-only generator the passage and the question are a prompt and the answer continues
it. One row per (question, passage):

    prompt[b, k] = tokens of join_context(title, text, question)     left-padded to S columns
    row[b, k]    = prompt[b, k] ++ answer[b, :T-1]                    S + T - 1 columns
    state[b,k,t] = backbone(row)[S - 1 + t]                           t = 0 .. T-1

so answer position t is predicted from the token before it (the last prompt token for t = 0)
and its target is ``answer[b, t]``. Left padding puts every row's last prompt token in column
S - 1, so the answer positions line up across the K rows. The padding is masked and the
position ids count real tokens only, so a padded row gives the states of the same row unpadded
(checked in tests/test_causal.py against an unpadded fp64 run). The states are the backbone's
last hidden states (its final norm applied): what the LM head reads, a plain linear map here
(heads that are not one, final-logit soft-capping or logit scaling, are refused).

Decoding: each prompt is prefilled once; its key/value cache is then shared by the W beams:
copied W times after the first step (when every beam still holds the bare prompt) and
reordered after the beams from then on. Each step feeds one token per (question, passage, beam)
row with position id ``real prompt length + answer index`` and the prompt's padding masked.
The searches are ``rag_token.rag_token_search`` and ``rag_sequence.rag_sequence_search``, as
for an encoder-decoder generator; RAG-Sequence's thorough rescoring scores ``logsumexp_k
(log p(z_k|x) + sum_t log p(y_t | x, z_k, y<t))``, EOS included, nothing after it.

Returned sequences are the answer tokens only (no prompt, no start token) ``[B*R, L]``,
padded with the generator's pad token after each answer's EOS (or its last token); L is the
longest returned answer.

Lengths: ``max_new_tokens`` (or ``max_length``, which here also counts answer tokens only, the
prompts' lengths differing) bounds the answer; ``min_new_tokens`` / ``min_length`` likewise.

Sampling (``do_sample`` with ``temperature``, ``top_k``, ``top_p``), ``repetition_penalty`` and
``no_repeat_ngram_size`` take a plain-PyTorch step instead of the fused one, with the
encoder-decoder semantics: RAG-Token processes the passage-marginal log-probabilities of each
(question, beam); RAG-Sequence processes each passage's own search (the generator's logits when
greedy, their log-softmax in beam search, as ``transformers``' ``generate`` does). As
``transformers`` does for a causal LM, the repetition penalty and the n-gram ban read the whole
sequence, the prompt's real tokens (not its padding) followed by the answer so far. RAG-Token
has K prompts per question: a token counts as seen, or an n-gram as present, when it is in any
of the K sequences ``prompt_k ++ answer`` (with one passage: exactly ``transformers``' rule).
Draws come from ``rng`` (a ``torch.Generator``; None: torch's global one), one draw per step for
all rows together: RAG-Token's questions, or all (question, passage) searches of RAG-Sequence.
"""
from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from rag_fast._validation import check_decoding_scores
from rag_fast.generation._generic_decoder import cache_argument
from rag_fast.generation._inputs import check_rng
from rag_fast.generation._search import DecodingSettings, settings_from
from rag_fast.generation.heads import LMHead, head_parent
from rag_fast.generation.rag_sequence import check_decoding, rag_sequence_search
from rag_fast.generation.rag_token import rag_token_search
from rag_fast.ops import rag_sequence_nll

# Rescoring (RAG-Sequence, thorough) materializes the logits of at most this many bytes at
# once: a cap on its peak memory (lower it to bound memory, at the cost of smaller matmuls).
SCORE_CHUNK_BYTES = 256 * 2**20


# Config fields that make the logits a non-linear or rescaled function of the last hidden
# state (RagModel's linear LM head would silently differ from the generator's own logits), with
# the values that leave them a plain linear map: soft-capping off (None or 0), scales of 1.
_NONLINEAR_HEAD_FIELDS = {"final_logit_softcapping": (None, 0, 0.0), "logit_scale": (None, 1, 1.0),
                          "logits_scaling": (None, 1, 1.0),
                          "output_multiplier_scale": (None, 1, 1.0)}


def backbone(generator: nn.Module) -> nn.Module:
    """The transformer under the LM head (``model`` for Llama/Qwen2/Mistral, ``transformer`` for
    GPT-2), which returns the final-normed hidden states."""
    for name in (getattr(generator, "base_model_prefix", None), "model", "transformer"):
        module = getattr(generator, name, None) if name else None
        if isinstance(module, nn.Module) and module is not generator:
            return module
    raise ValueError(
        f"generator {type(generator).__name__} has no 'model' or 'transformer' backbone: "
        "RagModel drives Hugging Face *ForCausalLM models")


def check_causal(generator: nn.Module) -> None:
    """Raise ValueError unless ``generator`` is a decoder-only LM RagModel can drive: a
    ``*ForCausalLM`` with a backbone, an ``nn.Linear`` LM head, a linear logits map and a
    ``pad_token_id``."""
    config = getattr(generator, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"generator {type(generator).__name__} is not a decoder-only model "
                         "(config.is_encoder_decoder must be False)")
    if not callable(getattr(generator, "get_output_embeddings", None)):
        raise ValueError(f"generator must be a Hugging Face *ForCausalLM with "
                         f"get_output_embeddings(); got {type(generator).__name__}")
    head = generator.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"generator's output embeddings must be nn.Linear, got "
                         f"{type(head).__name__}")
    parent = head_parent(generator, head)
    if parent is not None and parent is not generator and len(list(parent.children())) > 1:
        raise ValueError(
            f"generator {type(generator).__name__}'s LM head ({type(parent).__name__}) applies "
            "more than a Linear to the last hidden state, which RagModel's LM head (and its "
            "fused loss) assume; an encoder checkpoint (BERT, MiniLM, ...) is no decoder-only "
            "generator: warm-start an encoder-decoder from it instead")
    body = backbone(generator)
    try:
        accepts = inspect.signature(body.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature: trust the call
        accepts = {"position_ids": None}
    if "position_ids" not in accepts:
        raise ValueError(
            f"generator {type(generator).__name__}'s backbone takes no position_ids: RagModel "
            "left-pads prompts and needs positions that count real tokens only")
    _check_linear_logits(config)
    if getattr(config, "pad_token_id", None) is None:
        raise ValueError(
            "generator.config.pad_token_id is None: a decoder-only generator needs a pad token "
            "to pad prompts and answers; set generator.config.pad_token_id (e.g. to "
            "generator.config.eos_token_id, or the tokenizer's pad_token_id)")


def _check_linear_logits(config) -> None:
    for name, neutral in _NONLINEAR_HEAD_FIELDS.items():
        value = getattr(config, name, None)
        if value not in neutral:
            raise ValueError(
                f"generator config sets {name}={value!r}: its logits are not a plain linear map "
                "of the last hidden state, which RagModel's LM head (and its fused loss) assume")


def decoder_only_lm_head(generator: nn.Module) -> LMHead:
    """The generator's LM head as ``(weight [V, d], bias [V] or None, scale=1.0)``.

    Raises:
        ValueError: a head that is not ``nn.Linear`` or logits that are not linear in the
            hidden state (final-logit soft-capping, logit scaling).
    """
    head = generator.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"generator's output embeddings must be nn.Linear, got "
                         f"{type(head).__name__}")
    _check_linear_logits(generator.config)
    return LMHead(head.weight, head.bias, 1.0)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only: ``cumsum(mask) - 1``, 0 on leading padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def check_prompts(context_input_ids: torch.Tensor, context_attention_mask: torch.Tensor) -> None:
    """Prompts ``[N, S]`` must be integer ids with a mask of the same shape, left-padded: every
    row's last column a real token."""
    if context_input_ids.dim() != 2:
        raise ValueError(f"context_input_ids must be [B*K, S], got "
                         f"{tuple(context_input_ids.shape)}")
    if context_attention_mask is None or (tuple(context_attention_mask.shape)
                                          != tuple(context_input_ids.shape)):
        raise ValueError("context_attention_mask must have the shape of context_input_ids "
                         f"{tuple(context_input_ids.shape)}")
    if context_input_ids.shape[1] == 0:
        raise ValueError("context_input_ids has no columns: a decoder-only generator needs "
                         "a prompt")
    if not torch.compiler.is_compiling() and not bool(context_attention_mask[:, -1].bool().all()):
        raise ValueError(
            "context_input_ids must be left-padded for a decoder-only generator (the last "
            "column of every row a real token, context_attention_mask 1 there): tokenize with "
            "padding_side='left' (RagModel.build_contexts does)")


def answer_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  answer_ids: torch.Tensor) -> dict:
    """The backbone's inputs for prompts ``[N, S]`` (left-padded) continued by ``answer_ids``
    ``[N, T]``: ``input_ids``, ``attention_mask`` and ``position_ids`` of ``S + T - 1``
    columns (the last answer token is never an input). Answer padding needs no mask: it only
    follows the real answer tokens."""
    N = prompt_ids.shape[0]
    T = answer_ids.shape[1]
    ids = torch.cat([prompt_ids, answer_ids[:, : T - 1]], dim=1)
    mask = torch.cat([prompt_mask.to(torch.long),
                      prompt_mask.new_ones((N, T - 1), dtype=torch.long)], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask)}


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class _Session:
    """The prefilled prompts of N (question, passage) rows and their cached decoder, Q decoder
    rows per prompt (the beams: the prompt's cache is copied Q times by the first reorder)."""

    def __init__(self, adapter: DecoderOnly, Q: int, max_length: int) -> None:
        self.a, self.Q = adapter, Q
        N, max_new = adapter.ids.shape[0], max_length - 1
        mask = adapter.mask
        self.mask = torch.cat([mask, mask.new_ones((N, max_new))], dim=1)
        self.lengths = mask.sum(1)  # real prompt tokens per row: the first answer position
        out = adapter.body(input_ids=adapter.ids, attention_mask=mask,
                           position_ids=position_ids(mask), use_cache=True, return_dict=True)
        self.cache = _cache_of(out)
        self.first = adapter.logits(out.last_hidden_state[:, -1])  # [N, V]
        self.expanded = Q == 1

    def logits(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        if pos == 0:  # the prefill's logits, the same for every decoder row of a prompt
            return self.first[:, None, :].expand(-1, self.Q, -1)
        width = self.a.ids.shape[1] + pos
        out = self.a.body(input_ids=tokens.reshape(-1, 1), attention_mask=self.mask[:, :width],
                          position_ids=(self.lengths + pos - 1)[:, None], use_cache=True,
                          return_dict=True, **{self.a.cache_arg: self.cache})
        self.cache = _cache_of(out)
        return self.a.logits(out.last_hidden_state[:, -1]).view(-1, self.Q, self.first.shape[-1])

    def reorder(self, rows: torch.Tensor, length: int) -> None:
        if not self.expanded:  # every beam still holds the bare prompt: copy it Q times
            self.cache.batch_repeat_interleave(self.Q)
            self.mask = self.mask.repeat_interleave(self.Q, dim=0)
            self.lengths = self.lengths.repeat_interleave(self.Q)
            self.expanded = True
        else:  # same prompt: mask and lengths unchanged
            self.cache.reorder_cache(rows)


class DecoderOnly:
    """:class:`~rag_fast.generation._search.GeneratorAdapter` of a decoder-only generator over
    left-padded prompts ``ids [B*K, S]`` with ``mask``. Hypotheses carry a placeholder start
    column (the pad token), dropped on output."""

    sample_per_question = False  # one draw per step for all rows together

    def __init__(self, generator: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                 K: int) -> None:
        self.K = K
        self.ids, self.mask = ids, mask.to(torch.long)
        self.device = ids.device
        self.body = backbone(generator)
        self.cache_arg = cache_argument(self.body)
        self.head = decoder_only_lm_head(generator)
        self.vocab_size = int(self.head.weight.shape[0])
        self.pad_token_id = int(generator.config.pad_token_id)
        self.score_dtype = (torch.float64 if self.head.weight.dtype == torch.float64
                            else torch.float32)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.head.weight, self.head.bias)

    def session(self, Q: int, max_length: int, *, search: str = "token", rows=None) -> _Session:
        if rows is not None:
            raise ValueError("a decoder-only session covers every prompt row")
        return _Session(self, Q, max_length)

    def history(self, s: DecodingSettings, scores, seqs, group: int):
        G = scores.shape[0]
        S = self.ids.shape[1]
        return prompt_processors(s, scores, self.ids.view(G, group, S),
                                 self.mask.view(G, group, S), seqs[:, :, 1:])

    def hypotheses(self, hyps, lengths):
        """Answer tokens past each hypothesis' length become padding."""
        cols = torch.arange(hyps.shape[2], device=hyps.device)
        return hyps.masked_fill(cols[None, None, :] > lengths[:, :, None], self.pad_token_id)

    def bounds_hold(self, s: DecodingSettings) -> bool:
        return False

    def sequence_scores(self, uniq, lengths, valid, log_prior, impl, lower, keep):
        """Teacher forcing: rows (b, n, k) = prompt (b, k) ++ hypothesis (b, n), a chunk of
        questions at a time (the chunk's logits stay under SCORE_CHUNK_BYTES).

        Every prompt is run once (its keys and values cached, its last state kept: it predicts
        the first answer token); each row then runs only its answer's tokens over a copy of its
        prompt's cache. Running the whole prompt again for every (hypothesis, passage) row, as
        one teacher-forced pass would, repeats the prompt's work N times."""
        B, N = uniq.shape[:2]
        K, device, pad = self.K, self.device, self.pad_token_id
        answers = uniq[:, :, 1:].masked_fill(~valid[:, :, None], pad)
        L = answers.shape[2]
        cols = torch.arange(L, device=device)
        counted = (cols[None, None, :] < lengths[:, :, None]) & valid[:, :, None]
        targets = answers.masked_fill(~counted, -100)
        ids, mask, head = self.ids, self.mask, self.head
        V = self.vocab_size
        per_question = N * K * L * V * head.weight.element_size()
        step = max(1, SCORE_CHUNK_BYTES // max(1, per_question))
        scores = torch.empty((B, N), dtype=log_prior.dtype, device=device)
        prefill = self.body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                            use_cache=L > 1, return_dict=True)
        last = prefill.last_hidden_state[:, -1]  # [B*K, d]: predicts each answer's first token
        prompt_cache = _cache_of(prefill) if L > 1 else None
        real = mask.sum(1)  # real prompt tokens per row: the first answer token's position
        for b0 in range(0, B, step):
            b1 = min(B, b0 + step)
            nb = b1 - b0
            prompt_row = (torch.arange(b0, b1, device=device)[:, None, None] * K
                          + torch.arange(K, device=device)[None, None, :]).expand(nb, N, K)
            prompt_row = prompt_row.reshape(-1)
            rows = answers[b0:b1].repeat_interleave(K, dim=1).reshape(nb * N * K, L)
            states = last[prompt_row][:, None]
            if L > 1:  # the answers' other tokens, each row over its prompt's cached keys
                cache = copy.deepcopy(prompt_cache)
                cache.reorder_cache(prompt_row)
                M = rows.shape[0]
                out = self.body(
                    input_ids=rows[:, :L - 1],
                    attention_mask=torch.cat([mask[prompt_row], mask.new_ones((M, L - 1))], 1),
                    position_ids=real[prompt_row, None] + torch.arange(L - 1, device=device),
                    use_cache=True, return_dict=True, **{self.cache_arg: cache})
                states = torch.cat([states, out.last_hidden_state], dim=1)
                del cache, out
            logits = nn.functional.linear(states, head.weight, head.bias)  # [nb*N*K, L, V]
            prior = log_prior[b0:b1, None, :].expand(nb, N, K).reshape(nb * N, K)
            nll = rag_sequence_nll(logits, prior, targets[b0:b1].reshape(nb * N, L), n_docs=K,
                                   ignore_index=-100, reduction="none", impl=impl)
            scores[b0:b1] = (-nll).view(nb, N).to(log_prior.dtype)
            del logits, states
        return scores

    def token_output(self, seqs, lengths):
        """Hypotheses ``[M, 1 + L]`` (placeholder column 0) -> answers ``[M, longest]``."""
        width = max(1, int(lengths.max())) if lengths.numel() else 1
        out = seqs[:, 1:1 + width]
        cols = torch.arange(out.shape[1], device=out.device)
        return out.masked_fill(cols[None, :] >= lengths[:, None], self.pad_token_id)

    def sequence_output(self, chosen, lengths, found, width, R):
        B, n = chosen.shape[:2]
        lengths = lengths.masked_fill(~found, 0)
        if n < R:
            chosen = torch.cat([chosen, chosen.new_full((B, R - n, chosen.shape[2]),
                                                        self.pad_token_id)], dim=1)
            lengths = torch.cat([lengths, lengths.new_zeros((B, R - n))], dim=1)
        return self.token_output(chosen.reshape(B * R, -1), lengths.reshape(B * R))


def _resolve_settings(generator: nn.Module, generation_config, V: int, pad: int,
                      settings: dict) -> DecodingSettings:
    """``settings_from`` with the lengths counted in answer tokens and a placeholder start
    token (the hypotheses' column 0, dropped before returning).

    ``max_length`` given here counts answer tokens. From a generation config only
    ``max_new_tokens`` is read (default 20): a decoder-only config's ``max_length`` counts the
    prompt too (often the whole context window), which is no answer length."""
    cfg = generation_config if generation_config is not None else getattr(
        generator, "generation_config", None)
    settings = dict(settings)
    max_length = settings.pop("max_length", None)
    if settings.get("max_new_tokens") is None:
        if max_length is None:
            max_length = getattr(cfg, "max_new_tokens", None) or 20
        settings["max_new_tokens"] = int(max_length)
    min_length = settings.pop("min_length", None)
    if settings.get("min_new_tokens") is None:
        if min_length is None:
            min_length = (getattr(cfg, "min_new_tokens", None) or getattr(cfg, "min_length", None)
                          or 0)
        settings["min_new_tokens"] = int(min_length)
    settings["decoder_start_token_id"] = pad
    return settings_from(cfg, V, allow_processors=True, **settings)


def prompt_processors(s: DecodingSettings, scores: torch.Tensor, prompt_ids: torch.Tensor,
                      prompt_mask: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """``scores [E, W, V]`` (cast to float32) after the repetition penalty and the no-repeat
    n-gram ban of ``s``, over the sequences ``prompt_(e,k) ++ answer_(e,w)`` for every k.

    ``prompt_ids`` / ``prompt_mask`` ``[E, K, S]`` (left-padded; padding is not a token of the
    sequence), ``answers [E, W, A]`` the answer tokens so far (A >= 0, no placeholder).
    Repetition penalty p: a token present in any of the K sequences has its score x become
    ``x * p`` if ``x < 0`` else ``x / p`` (once). No-repeat n-grams n: a token that would
    complete an n-gram already present in one of the K sequences (its last n-1 tokens followed
    by that token) gets ``-inf``.
    """
    scores = scores.float()
    E, W, V = scores.shape
    K, S = prompt_ids.shape[1:]
    A = answers.shape[2]
    device = scores.device
    real = prompt_mask.bool()
    if s.repetition_penalty != 1.0:
        counts = torch.zeros((E, V), dtype=torch.int32, device=device)
        counts.scatter_add_(1, prompt_ids.reshape(E, K * S), real.reshape(E, K * S).int())
        seen = (counts > 0)[:, None, :].expand(E, W, V)
        if A:
            in_answer = torch.zeros((E, W, V), dtype=torch.int32, device=device)
            in_answer.scatter_add_(2, answers, torch.ones_like(answers, dtype=torch.int32))
            seen = seen | (in_answer > 0)
        p = s.repetition_penalty
        scores = torch.where(seen, torch.where(scores < 0, scores * p, scores / p), scores)
    n = s.no_repeat_ngram_size
    if n > 0 and S + A >= n:
        full = torch.cat([prompt_ids[:, None].expand(E, W, K, S),
                          answers[:, :, None].expand(E, W, K, A)], dim=3)  # [E, W, K, S+A]
        valid = torch.cat([real[:, None].expand(E, W, K, S),
                           real.new_ones((E, W, K, A))], dim=3)
        windows = full.unfold(3, n, 1)  # [E, W, K, S+A-n+1, n]
        inside = valid.unfold(3, n, 1).all(dim=-1)  # windows of real tokens only
        tail = full[..., S + A - (n - 1):]  # the last n-1 tokens (real whenever a window is)
        hit = (windows[..., : n - 1] == tail[..., None, :]).all(dim=-1) & inside
        banned = torch.zeros((E, W, V), dtype=torch.int32, device=device)
        banned.scatter_add_(2, windows[..., n - 1].reshape(E, W, -1),
                            hit.reshape(E, W, -1).int())
        scores = scores.masked_fill(banned > 0, float("-inf"))
    return scores


@torch.no_grad()
def causal_generate(
    generator: nn.Module,
    context_input_ids: torch.Tensor,
    context_attention_mask: torch.Tensor | None,
    doc_scores: torch.Tensor,
    *,
    mode: str = "token",
    decoding: str = "thorough",
    impl: str = "auto",
    generation_config=None,
    n_docs: int | None = None,
    num_return_sequences: int | None = None,
    rng: torch.Generator | None = None,
    mask_searches: bool = True,
    **settings,
) -> torch.Tensor:
    """Answer with RAG-Token (``mode="token"``) or RAG-Sequence (``"sequence"``) decoding over a
    decoder-only generator.

    Args:
        generator: a ``*ForCausalLM`` (see :func:`check_causal`).
        context_input_ids: ``[B*K, S]`` prompts (passage and question), left-padded, K rows
            per question.
        context_attention_mask: ``[B*K, S]`` (1: token, 0: padding), or None (all ones).
        doc_scores: ``[B, K]`` passage scores; ``-inf`` marks a missing passage.
        mode: ``"token"`` or ``"sequence"``; decoding: RAG-Sequence's ``"thorough"`` or
            ``"fast"``.
        impl: beam-step backend (``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"``).
        generation_config: defaults (None: the generator's ``generation_config``).
        num_return_sequences: answers per question (RAG-Token: at most num_beams).
        rng: the ``torch.Generator`` sampling draws from (None: torch's global generator).
        mask_searches: accepted for symmetry with
            :func:`~rag_fast.generation.rag_sequence_generate`: a decoder-only prompt's
            padding is always masked, so False is refused.
        **settings: ``num_beams``, ``max_new_tokens`` / ``max_length`` (answer tokens),
            ``min_new_tokens`` / ``min_length``, ``length_penalty``, ``early_stopping``,
            ``eos_token_id``, ``pad_token_id``, ``forced_bos_token_id`` (the first answer
            token), ``forced_eos_token_id``, ``do_sample``, ``temperature``, ``top_k``,
            ``top_p``, ``repetition_penalty``, ``no_repeat_ngram_size`` (see the module
            docstring for what the last two read).

    Returns:
        ``[B*R, L]`` int64 answer token ids (R answers per question, best first), padded with
        the pad token; a RAG-Sequence question with fewer than R distinct hypotheses gets rows
        of padding.

    Raises:
        ValueError: a generator RagModel cannot drive, bad shapes, prompts not left-padded,
            a NaN or all -inf passage scores, prompt plus answer longer than the positions.
    """
    if mode not in ("token", "sequence"):
        raise ValueError(f"mode must be 'token' or 'sequence', got {mode!r}")
    check_decoding(decoding)
    if not mask_searches:
        raise ValueError("mask_searches=False: a decoder-only generator's searches always mask "
                         "the prompts' padding")
    check_causal(generator)
    check_rng(rng)
    if not isinstance(doc_scores, torch.Tensor) or doc_scores.dim() != 2 \
            or not doc_scores.is_floating_point():
        raise ValueError("doc_scores must be a [B, K] floating tensor")
    B, K = doc_scores.shape
    if n_docs is not None and n_docs != K:
        raise ValueError(f"n_docs={n_docs} does not match doc_scores.shape[1]={K}")
    if not isinstance(context_input_ids, torch.Tensor) or context_input_ids.dim() != 2 \
            or context_input_ids.shape[0] != B * K:
        raise ValueError(f"context_input_ids must be [B*K, S] = [{B}*{K}, S], got "
                         f"{tuple(getattr(context_input_ids, 'shape', ()))}")
    if context_attention_mask is None:
        context_attention_mask = torch.ones_like(context_input_ids)
    check_prompts(context_input_ids, context_attention_mask)
    check_decoding_scores(doc_scores.detach())
    adapter = DecoderOnly(generator, context_input_ids.long(), context_attention_mask, K)
    if mode == "sequence":
        R = int(num_return_sequences or 1)
        if settings.get("num_beams") is None:
            settings["num_beams"] = 1
        settings["num_return_sequences"] = settings["num_beams"]
    elif num_return_sequences is not None:
        settings["num_return_sequences"] = num_return_sequences
    s = _resolve_settings(generator, generation_config, adapter.vocab_size,
                          adapter.pad_token_id, settings)
    max_new = s.max_length - 1
    limit = getattr(generator.config, "max_position_embeddings", None)
    if limit and context_input_ids.shape[1] + max_new - 1 > int(limit):
        raise ValueError(
            f"prompts of {context_input_ids.shape[1]} tokens and up to {max_new} answer tokens "
            f"need {context_input_ids.shape[1] + max_new - 1} positions but the generator has "
            f"{limit} (config.max_position_embeddings); shorten the prompts or max_new_tokens")
    log_prior = torch.log_softmax(doc_scores.detach().to(adapter.score_dtype), dim=1)
    if mode == "token":
        return rag_token_search(adapter, log_prior, s, B, K, impl, rng)
    return rag_sequence_search(adapter, log_prior, s, B, K, R, decoding, impl, rng)


__all__ = ["DecoderOnly", "answer_inputs", "backbone", "causal_generate", "check_causal",
           "check_prompts", "decoder_only_lm_head", "position_ids", "prompt_processors"]
