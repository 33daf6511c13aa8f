"""RAG decoding: RAG-Token greedy/beam search/sampling, RAG-Sequence thorough and fast decoding,
one search per mode over a generator adapter per family: any Hugging Face encoder-decoder
generator (BART through a lean fast path; T5, Pegasus, Marian, mBART, ... through their own
decoder modules: ``encoder_decoder``) and any decoder-only ``*ForCausalLM`` (``causal``)."""
from rag_fast.generation._decoder import UnsupportedGeneratorError
from rag_fast.generation._search import start_token_id
from rag_fast.generation.causal import causal_generate
from rag_fast.generation.encoder_decoder import make_decoder
from rag_fast.generation.rag_sequence import rag_sequence_generate
from rag_fast.generation.rag_token import rag_token_generate

__all__ = ["UnsupportedGeneratorError", "causal_generate", "make_decoder",
           "rag_sequence_generate", "rag_token_generate", "start_token_id"]
