"""Train the small WordPiece tokenizer in ``generator-tokenizer/`` on this folder's passages and
questions (what ``rag-fast init --generator-tokenizer`` takes for the example generator).

A vocabulary fitted to the corpus (4,000 entries, lower-cased, BERT-style special tokens) keeps
the from-scratch generator's embeddings and LM head small: most words are one token, so
copying an answer out of a passage is a few steps to learn. Run from anywhere:
``python examples/workflow/make_tokenizer.py``; the result is deterministic.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def texts() -> list[str]:
    out = []
    for name in ("passages.jsonl", "train.jsonl", "dev.jsonl"):
        for line in (HERE / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            out += [row.get("title", ""), row.get("text", ""), row.get("question", "")]
            out += row.get("answers", [])
    return [t for t in out if t]


def main(vocab_size: int = 4000) -> Path:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts(), WordPieceTrainer(vocab_size=vocab_size,
                                                      special_tokens=SPECIAL, min_frequency=1))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=256)
    out = HERE / "generator-tokenizer"
    fast.save_pretrained(str(out))
    return out


if __name__ == "__main__":
    print(f"wrote {main()}")
