"""Generator families (rag_fast/models/family.py): the encoder-decoder / decoder-only decision
is made once, by the family the generator belongs to, and a third family is one class and one
register_family call, touching no library file: here a recurrent toy LM (an embedding, a GRU
and a linear head, no transformers model) trains through RagModel's fused losses, checked in
float64 against rag_fast.reference over logits computed by hand, and answers through its own
greedy decoding."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rag_fast import reference
from rag_fast.generation.heads import LMHead
from rag_fast.models import RagModel
from rag_fast.models.family import (DecoderOnly, EncoderDecoder, GeneratorFamily, families,
                                    family_of, family_of_config, register_family,
                                    unregister_family)

PAD, EOS, V, D = 0, 1, 23, 8
IGNORE = -100


class ToyGRU(nn.Module):
    """A recurrent LM: no transformers model, no ``is_encoder_decoder``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="toy-gru", pad_token_id=PAD, eos_token_id=EOS,
                                      vocab_size=V)
        self.embed = nn.Embedding(V, D)
        self.rnn = nn.GRU(D, D, batch_first=True)
        self.head = nn.Linear(D, V)

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.embed(ids))[0]


class Recurrent(GeneratorFamily):
    """The third family: prompt and answer run through the GRU as one sequence; state t (the
    one after the prompt's last token and the answer's first t tokens) predicts answer token t."""

    name = "recurrent"
    layout = "toy-recurrent"
    decoder_only = True
    padding_side = "left"

    def claims_config(self, config):
        return getattr(config, "model_type", None) == "toy-gru"

    def check(self, generator):
        if not isinstance(generator, ToyGRU):
            raise ValueError("the recurrent family drives ToyGRU only")

    def lm_head(self, generator):
        return LMHead(generator.head.weight, generator.head.bias, 1.0)

    def ignore_index(self, pad_token_id):
        return IGNORE

    def label_padding(self, pad_token_id):
        return IGNORE

    def prepare_labels(self, labels, pad_token_id, config):
        return labels.masked_fill(labels == IGNORE, pad_token_id), labels

    def states(self, generator, context_input_ids, context_attention_mask, decoder_input_ids,
               K, tied):
        S, T = context_input_ids.shape[1], decoder_input_ids.shape[1]
        ids = torch.cat([context_input_ids, decoder_input_ids.repeat_interleave(K, 0)], 1)
        return generator.hidden(ids)[:, S - 1:S - 1 + T]

    def generate(self, model, context_input_ids, context_attention_mask, doc_scores, *,
                 decoding, impl, settings):
        """RAG-Token greedy: each step's next token maximises the passage-marginal."""
        B, K = doc_scores.shape
        prior = torch.log_softmax(doc_scores.double(), -1)  # [B, K]
        ids = context_input_ids
        out = []
        for _ in range(settings.get("max_new_tokens", 4)):
            logp = torch.log_softmax(model.generator.head(model.generator.hidden(ids)[:, -1])
                                     .double(), -1).view(B, K, -1)
            step = torch.logsumexp(prior[:, :, None] + logp, 1).argmax(-1)  # [B]
            out.append(step)
            ids = torch.cat([ids, step.repeat_interleave(K)[:, None]], 1)
        return torch.stack(out, 1)


@pytest.fixture
def recurrent():
    family = Recurrent()
    register_family(family)
    yield family
    unregister_family(family)


def _contexts(B: int, K: int, S: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B * K, S), generator=gen)
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("lm_head_loss", ["fused", "materialized"])
def test_a_third_family_trains_through_the_fused_losses(recurrent, mode, lm_head_loss):
    torch.manual_seed(0)
    g = ToyGRU().double()
    model = RagModel(g, mode=mode, n_docs=3, epsilon=0.1, lm_head_loss=lm_head_loss)
    assert model.family is recurrent and model.is_causal
    B, K = 2, 3
    ids, mask = _contexts(B, K, 5)
    scores = torch.tensor([[0.3, -0.2, 1.1], [0.5, 0.1, float("-inf")]], dtype=torch.float64,
                          requires_grad=True)
    labels = torch.tensor([[5, 6, 7, EOS], [8, EOS, IGNORE, IGNORE]])
    loss = model.loss_from_contexts(ids, mask, scores, labels, reduction="none")
    params = list(g.parameters())
    grads = torch.autograd.grad(loss.sum(), [scores, *params])

    # the oracle: the toy's logits by hand, then rag_fast.reference's loss
    ref_scores = scores.detach().clone().requires_grad_(True)
    answer = labels.masked_fill(labels == IGNORE, PAD).repeat_interleave(K, 0)
    states = g.hidden(torch.cat([ids, answer], 1))[:, 4:4 + labels.shape[1]]
    nll = reference.rag_token_nll if mode == "token" else reference.rag_sequence_nll
    ref = nll(g.head(states), ref_scores, labels, n_docs=K, epsilon=0.1, ignore_index=IGNORE)
    ref_grads = torch.autograd.grad(ref.sum(), [ref_scores, *params])
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert model.count_targets(labels) == 6  # the -100s left out


def test_a_third_family_answers_through_its_own_decoding(recurrent):
    torch.manual_seed(1)
    g = ToyGRU().double()
    model = RagModel(g, n_docs=2)
    ids, mask = _contexts(2, 2, 4, seed=3)
    scores = torch.tensor([[0.2, 0.9], [-0.5, 0.4]], dtype=torch.float64)
    out = model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                         max_new_tokens=3)
    assert out.sequences.shape == (2, 3)
    prior = torch.log_softmax(scores, -1)
    first = torch.log_softmax(g.head(g.hidden(ids)[:, -1]), -1).view(2, 2, -1)
    assert torch.equal(out.sequences[:, 0], torch.logsumexp(prior[:, :, None] + first, 1)
                       .argmax(-1))


def test_without_the_third_family_its_generator_is_refused():
    """The fixture's family is what makes the toy usable: unregistered, the toy falls to the
    decoder-only family (no is_encoder_decoder), whose checks refuse it."""
    assert family_of(ToyGRU()).name == "decoder-only"
    with pytest.raises(ValueError):
        RagModel(ToyGRU(), n_docs=2)


def test_the_family_is_chosen_once_from_the_config():
    encdec = SimpleNamespace(is_encoder_decoder=True)
    decoder = SimpleNamespace(is_encoder_decoder=False)
    assert isinstance(family_of_config(encdec), EncoderDecoder)
    assert isinstance(family_of_config(decoder), DecoderOnly)
    assert isinstance(family_of_config(None), EncoderDecoder)  # (its check then says why)
    assert [f.name for f in families()] == ["decoder-only", "encoder-decoder"]


def test_is_causal_is_decided_in_the_family_module_only():
    """No library module outside family.py asks a config whether it is an encoder-decoder to
    choose a path (generation's own input checks name the flag in their messages only)."""
    import rag_fast

    root = __import__("pathlib").Path(rag_fast.__file__).parent
    deciders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "family.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ("is_encoder_decoder" in line and "getattr" in line
                    and "raise" not in line and "must" not in line):
                deciders.append(f"{path.relative_to(root)}:{n}")
    allowed = {"generation/causal.py", "generation/_decoder.py", "models/_seq2seq.py"}
    assert {d.split(":")[0] for d in deciders} <= allowed, deciders


def test_a_decoder_only_model_whose_config_claims_an_encoder_is_refused():
    """The fifth hostile pass (M03): a decoder-only model folder whose generator config was
    edited to is_encoder_decoder=True decoded through the encoder-decoder path and ended in an
    AttributeError. The encoder-decoder family's check refuses a model with no encoder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    g = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2))
    g.config.is_encoder_decoder = True
    with pytest.raises(ValueError, match="has no encoder of its own"):
        RagModel(g, n_docs=2)
