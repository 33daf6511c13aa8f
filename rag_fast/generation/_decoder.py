"""A lean incremental decoder over a Hugging Face BART-family generator (same weights).

Why not call the generator's own forward: ``transformers`` copies the encoder outputs once per
beam, recomputes the cross-attention keys/values per beam and re-gathers them at every step.
Here the cross-attention keys/values are computed once per (question, passage) and shared by
every decoder row that reads that passage: decoder rows are grouped as ``[E, Q]`` (E encoder
rows, Q rows reading each, e.g. the W beams), and the Q queries of a group are attended
together as one ``[Q, S]`` score block, so nothing is copied per beam. The self-attention cache
is preallocated ``[E*Q, H, T_max, hd]`` and reordered in place by a gather.

The math is the generator's: BART's post-layer-norm decoder (learned positions with offset 2,
scaled embeddings, layernorm_embedding), ``lm_head`` plus ``final_logits_bias``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Whether an incremental decoder step on the CPU runs on one intra-op thread (the LM head, which
# is not part of it, keeps every thread). A step is many small ops: on cores shared with other
# work each multi-threaded op waits at a barrier for a thread that may not be scheduled, and the
# step runs slower than on one thread. Measured (docs/tuning.md, "Decoding"), one thread was as
# fast as timing both modes per shape at run time (the former StepThreads) and far faster than
# all threads on shared cores; set False (module attribute) to run steps on every thread.
STEP_ONE_THREAD = True


@contextmanager
def _single_thread(enabled: bool):
    """Run the block with one intra-op thread, restoring the caller's setting afterwards."""
    before = torch.get_num_threads()
    if not enabled or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class UnsupportedGeneratorError(ValueError):
    """The generator is not an encoder-decoder model rag_fast.generation can drive."""


def check_generator(generator: torch.nn.Module) -> None:
    """Raise UnsupportedGeneratorError unless ``generator`` is a Hugging Face encoder-decoder
    LM (an encoder, a decoder and an LM head): BART, mBART, Pegasus, Marian, T5, mT5, ..."""
    config = getattr(generator, "config", None)
    if config is None or not getattr(config, "is_encoder_decoder", False):
        raise UnsupportedGeneratorError(
            f"the generator must be an encoder-decoder model (config.is_encoder_decoder=True); "
            f"got {type(generator).__name__}, which has no encoder to read the passages"
        )
    for name in ("get_encoder", "get_decoder", "get_output_embeddings"):
        if not callable(getattr(generator, name, None)):
            raise UnsupportedGeneratorError(
                f"{type(generator).__name__} has no {name}(): rag_fast.generation drives "
                "seq2seq LMs with an encoder, a decoder and an LM head"
            )
    head = generator.get_output_embeddings()
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise UnsupportedGeneratorError(
            f"{type(generator).__name__}'s output embeddings have no weight (got "
            f"{type(head).__name__}); an LM head is needed"
        )


def is_bart(generator: torch.nn.Module) -> bool:
    """Whether the lean :class:`BartDecoder` can drive ``generator`` (a BART model whose
    decoder has the layout it re-implements); other generators use the generic decoder."""
    if getattr(getattr(generator, "config", None), "model_type", None) != "bart":
        return False
    decoder = getattr(getattr(generator, "model", None), "decoder", None)
    layers = getattr(decoder, "layers", None)
    needed = ("self_attn", "encoder_attn", "self_attn_layer_norm", "encoder_attn_layer_norm",
              "fc1", "fc2", "final_layer_norm")
    return (
        layers is not None
        and getattr(decoder, "layernorm_embedding", None) is not None
        and all(hasattr(layer, name) for layer in layers for name in needed)
        and hasattr(generator, "lm_head")
    )


@dataclass
class CrossState:
    """Cross-attention inputs shared by every decoder row reading an encoder row."""

    keys: list[torch.Tensor]  # per layer [E, H, S, hd]
    values: list[torch.Tensor]  # per layer [E, H, S, hd]
    mask: torch.Tensor | None  # [E, 1, 1, S] bool (True: attend), or None

    @property
    def device(self) -> torch.device:
        return self.keys[0].device


class SelfAttentionCache(list):
    """The decoder's self-attention cache: per layer one ``[2, rows, H, max_len, hd]`` buffer,
    plus one spare buffer of the same shape that reordering gathers into (then swaps with the
    layer's), so that reordering beams copies each layer once and allocates nothing."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__(buffers)
        self.spare = torch.empty_like(buffers[0]) if buffers else None


class BartDecoder:
    """Incremental and teacher-forced decoding with the weights of a BART generator."""

    def __init__(self, generator: torch.nn.Module) -> None:
        check_generator(generator)
        if not is_bart(generator):
            raise UnsupportedGeneratorError(
                f"BartDecoder drives BART generators only, got {type(generator).__name__} "
                "(use make_decoder, which picks the generic decoder for other models)"
            )
        self.generator = generator
        self.decoder = generator.model.decoder
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        self.heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.lm_weight = generator.lm_head.weight
        self.lm_bias = getattr(generator, "final_logits_bias", None)
        self.vocab_size = self.lm_weight.shape[0]
        self.d_model = self.lm_weight.shape[1]
        self.ffn_dim = max(layer.fc1.out_features for layer in self.layers)
        self._step_buf: torch.Tensor | None = None  # step_logits' reused output

    # encoder side -----------------------------------------------------------------------
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Encoder outputs ``[N, S, d]`` of ``input_ids [N, S]``."""
        out = self.generator.get_encoder()(
            input_ids=input_ids, attention_mask=attention_mask, return_dict=True
        )
        return out.last_hidden_state

    def cross_state(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> CrossState:
        """Per-layer cross-attention keys/values of encoder outputs ``hidden [E, S, d]``."""
        E, S, _ = hidden.shape
        keys, values = [], []
        for layer in self.layers:
            attn = layer.encoder_attn
            keys.append(attn.k_proj(hidden).view(E, S, self.heads, self.head_dim).transpose(1, 2))
            values.append(attn.v_proj(hidden).view(E, S, self.heads, self.head_dim).transpose(1, 2))
        mask = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            mask = attention_mask.bool()[:, None, None, :]
        return CrossState(keys, values, mask)

    def select_cross(self, cross: CrossState, rows: torch.Tensor) -> CrossState:
        """The cross state of encoder rows ``rows`` (a gather, for a new grouping)."""
        return CrossState(
            [k.index_select(0, rows) for k in cross.keys],
            [v.index_select(0, rows) for v in cross.values],
            None if cross.mask is None else cross.mask.index_select(0, rows),
        )

    # decoder side -----------------------------------------------------------------------
    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        emb = self.decoder.embed_tokens(tokens)  # includes BART's embed_scale
        pos = F.embedding(positions + self.decoder.embed_positions.offset,
                          self.decoder.embed_positions.weight)
        return self.decoder.layernorm_embedding(emb + pos)

    def _cross_attend(self, layer_idx: int, q: torch.Tensor, cross: CrossState, Q: int, T: int):
        """q ``[E*Q, H, T, hd]`` -> ``[E*Q, T, H*hd]``, attending per group of Q rows."""
        E = q.shape[0] // Q
        # Fold the Q rows of a group and their positions into one query axis: [E, H, Q*T, hd].
        qg = q.view(E, Q, self.heads, T, self.head_dim).transpose(1, 2).reshape(
            E, self.heads, Q * T, self.head_dim)
        out = F.scaled_dot_product_attention(
            qg, cross.keys[layer_idx], cross.values[layer_idx], attn_mask=cross.mask,
            scale=self.scaling)
        out = out.view(E, self.heads, Q, T, self.head_dim).permute(0, 2, 3, 1, 4)
        return out.reshape(E * Q, T, self.heads * self.head_dim)

    def _layers(self, h: torch.Tensor, cross: CrossState, Q: int, self_kv) -> torch.Tensor:
        """Run every layer on ``h [R, T, d]``; ``self_kv(layer_idx, k, v) -> (k_all, v_all,
        causal)`` supplies the self-attention keys/values (cache or the sequence itself)."""
        R, T, _ = h.shape
        for i, layer in enumerate(self.layers):
            sa = layer.self_attn
            q = sa.q_proj(h).view(R, T, self.heads, self.head_dim).transpose(1, 2)
            k = sa.k_proj(h).view(R, T, self.heads, self.head_dim).transpose(1, 2)
            v = sa.v_proj(h).view(R, T, self.heads, self.head_dim).transpose(1, 2)
            k_all, v_all, causal = self_kv(i, k, v)
            a = F.scaled_dot_product_attention(q, k_all, v_all, is_causal=causal, scale=self.scaling)
            h = layer.self_attn_layer_norm(h + sa.out_proj(a.transpose(1, 2).reshape(R, T, -1)))
            ca = layer.encoder_attn
            cq = ca.q_proj(h).view(R, T, self.heads, self.head_dim).transpose(1, 2)
            h = layer.encoder_attn_layer_norm(h + ca.out_proj(self._cross_attend(i, cq, cross, Q, T)))
            h = layer.final_layer_norm(h + layer.fc2(layer.activation_fn(layer.fc1(h))))
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: ``hidden [..., d]`` -> ``[..., V]`` (plus BART's final_logits_bias)."""
        out = F.linear(hidden, self.lm_weight)
        if self.lm_bias is not None:
            out += self.lm_bias.view(-1)  # in place: the same additions, one tensor less
        return out

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`logits` (the same values) written into a buffer that every call on this
        decoder reuses, ``hidden [..., d]`` -> ``[..., V]``; the buffer grows to the most rows
        seen. The result is valid until the next call: callers consume it (beam step, argmax,
        row statistics) before asking again.

        The logits are the largest tensor of a decoding step ([N, 50265] fp32: 32 MB for
        N=160); allocating them afresh every step (and once more for the bias addition) costs
        a page fault per 4 KiB page, since tensors this large are mapped fresh by the
        allocator (measured gain: docs/tuning.md, "Decoding").
        """
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        n = flat.shape[0]
        buf = self._step_buf
        if (buf is None or buf.shape[0] < n or buf.dtype != flat.dtype
                or buf.device != flat.device):
            buf = self._step_buf = torch.empty((n, self.vocab_size), dtype=flat.dtype,
                                               device=flat.device)
        out = buf[:n]
        torch.mm(flat, self.lm_weight.t(), out=out)
        if self.lm_bias is not None:
            out += self.lm_bias.view(-1)
        return out.view(*lead, self.vocab_size)

    def new_cache(self, rows: int, max_len: int) -> SelfAttentionCache:
        """An empty self-attention cache: per layer one ``[2, rows, H, max_len, hd]`` buffer."""
        p = self.lm_weight
        return SelfAttentionCache([
            torch.empty((2, rows, self.heads, max_len, self.head_dim), dtype=p.dtype,
                        device=p.device) for _ in self.layers])

    def step(self, tokens: torch.Tensor, pos: int, cache: list[torch.Tensor], cross: CrossState,
             Q: int) -> torch.Tensor:
        """One incremental step: ``tokens [E*Q]`` at position ``pos`` -> hidden ``[E*Q, d]``."""
        positions = torch.full((1,), pos, dtype=torch.long, device=tokens.device)

        def self_kv(i, k, v):
            cache[i][0, :, :, pos] = k[:, :, 0]
            cache[i][1, :, :, pos] = v[:, :, 0]
            return cache[i][0, :, :, : pos + 1], cache[i][1, :, :, : pos + 1], False

        with _single_thread(STEP_ONE_THREAD and tokens.device.type == "cpu"):
            return self._layers(self._embed(tokens[:, None], positions), cross, Q, self_kv)[:, 0]

    @staticmethod
    def reorder_cache(cache: list[torch.Tensor], rows: torch.Tensor, length: int) -> None:
        """Row r of the cache becomes old row ``rows[r]`` (positions ``< length``).

        A :class:`SelfAttentionCache` gathers each layer into its spare buffer, which then
        takes the layer's place (one copy, no allocation); a plain list is gathered in place."""
        if isinstance(cache, SelfAttentionCache):
            for i in range(len(cache)):
                spare = cache.spare
                torch.index_select(cache[i][:, :, :, :length], 1, rows,
                                   out=spare[:, :, :, :length])
                cache.spare, cache[i] = cache[i], spare
            return
        for buf in cache:
            buf[:, :, :, :length] = buf[:, :, :, :length].index_select(1, rows)

    def teacher_forced(self, tokens: torch.Tensor, cross: CrossState, Q: int) -> torch.Tensor:
        """Hidden states ``[E*Q, T, d]`` of decoder inputs ``tokens [E*Q, T]`` (causal)."""
        T = tokens.shape[1]
        positions = torch.arange(T, device=tokens.device)
        h = self._embed(tokens, positions)
        return self._layers(h, cross, Q, lambda i, k, v: (k, v, T > 1))
