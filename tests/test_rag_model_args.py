"""RagModel refuses bad constructor arguments at once, naming the argument."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rag_fast.models import RagModel
from rag_fast.testing import tiny_hf_rag


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_rag("token", n_docs=3)


def _build(hf, **kwargs) -> RagModel:
    # lean_activations=False: no generator preparation (the model is shared by the tests)
    kwargs.setdefault("lean_activations", False)
    return RagModel(hf.rag.generator, hf.rag.question_encoder, **kwargs)


@pytest.mark.parametrize("name,value,expected", [
    ("max_context_length", 12.7, "must be a positive int"),
    ("max_context_length", 12.0, "must be a positive int"),
    ("max_context_length", "64", "must be a positive int"),
    ("max_context_length", True, "must be a positive int"),
    ("max_context_length", 0, "must be a positive int"),
    ("max_context_length", -3, "must be a positive int"),
    ("max_context_length", None, "must be a positive int"),
    ("max_question_length", 12.7, "must be a positive int"),
    ("max_question_length", "64", "must be a positive int"),
    ("max_question_length", False, "must be a positive int"),
    ("max_question_length", 0, "must be a positive int"),
    ("loss_impl", "cuda", r"must be one of \('auto', 'cpp', 'triton', 'torch'\)"),
    ("loss_impl", "Torch", "must be one of"),
    ("loss_impl", None, "must be one of"),
    ("loss_impl", 1, "must be one of"),
    ("epsilon", -0.1, r"must be a float in \[0, 1\]"),
    ("epsilon", 1.5, r"must be a float in \[0, 1\]"),
    ("epsilon", 2, r"must be a float in \[0, 1\]"),
    ("epsilon", float("nan"), r"must be a float in \[0, 1\]"),
    ("epsilon", float("inf"), r"must be a float in \[0, 1\]"),
    ("epsilon", "0.1", r"must be a float in \[0, 1\]"),
    ("epsilon", True, r"must be a float in \[0, 1\]"),
    ("epsilon", None, r"must be a float in \[0, 1\]"),
    ("exclude_bos", 1, "must be True or False"),
    ("exclude_bos", "yes", "must be True or False"),
    ("exclude_bos", None, "must be True or False"),
    ("normalize_questions", 0, "must be True or False"),
    ("normalize_questions", "false", "must be True or False"),
    ("lean_activations", 1, "must be True or False"),
    ("bos_token_id", -1, "must be None or a non-negative int"),
    ("bos_token_id", 0.0, "must be None or a non-negative int"),
    ("bos_token_id", "0", "must be None or a non-negative int"),
    ("bos_token_id", True, "must be None or a non-negative int"),
    ("n_docs", True, "must be a positive int"),
    ("n_docs", 3.0, "must be a positive int"),
])
def test_a_bad_argument_raises_a_value_error_naming_it(hf, name, value, expected):
    with pytest.raises(ValueError, match=f"^{name} {expected}.*, got ") as info:
        _build(hf, **{name: value})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("kwargs", [
    {},
    {"epsilon": 0}, {"epsilon": 0.0}, {"epsilon": 0.1}, {"epsilon": 1.0}, {"epsilon": 1},
    {"max_context_length": 1, "max_question_length": 1},
    {"max_context_length": 4096, "max_question_length": 512},
    {"loss_impl": "auto"}, {"loss_impl": "cpp"}, {"loss_impl": "triton"}, {"loss_impl": "torch"},
    {"exclude_bos": True, "normalize_questions": True},
    {"bos_token_id": None}, {"bos_token_id": 0}, {"bos_token_id": 7},
    # numpy scalars (e.g. read from an array of settings) count as the numbers they are
    {"max_context_length": np.int64(32), "bos_token_id": np.int32(0), "epsilon": np.float32(0.5)},
])
def test_valid_arguments_are_kept(hf, kwargs):
    model = _build(hf, **kwargs)
    options = model.options()
    for key, value in kwargs.items():
        if key == "bos_token_id" and value is None:  # the generator config's (0 here)
            assert options[key] == hf.rag.generator.config.bos_token_id
        else:
            # stored as Python numbers (a numpy int as an int): options() is saved as JSON
            want = float if key == "epsilon" else int if isinstance(value, np.integer) else type(
                value)
            assert options[key] == value and type(options[key]) is want
    assert isinstance(model.epsilon, float)


def test_options_round_trip_through_json(hf):
    model = _build(hf, mode="sequence", epsilon=0.0, exclude_bos=True, bos_token_id=0,
                   normalize_questions=True, max_context_length=1, max_question_length=9,
                   loss_impl="torch")
    options = json.loads(json.dumps(model.options()))
    assert options["epsilon"] == 0.0 and isinstance(options["epsilon"], float)
    again = _build(hf, **options)
    assert again.options() == model.options()
    json.dumps(_build(hf, n_docs=np.int64(3), max_question_length=np.int16(5)).options())


def test_a_checked_argument_fails_before_the_generator_is_inspected():
    # a module RagModel cannot drive: the argument's error comes first
    with pytest.raises(ValueError, match="^max_context_length must be a positive int"):
        RagModel(torch.nn.Linear(2, 2), max_context_length="64")


def test_build_rag_model_checks_the_options_before_loading_anything(tmp_path):
    from rag_fast.models.build import build_rag_model

    # no such generator or encoder: the option's error comes first
    with pytest.raises(ValueError, match=r"^epsilon must be a float in \[0, 1\], got 1.5$"):
        build_rag_model(generator=str(tmp_path / "none"), question_encoder="none", epsilon=1.5)
    with pytest.raises(ValueError, match="^n_docs must be a positive int, got 0$"):
        build_rag_model(generator=str(tmp_path / "none"), question_encoder="none", n_docs=0)


def test_a_generator_config_bos_that_is_no_id_is_not_kept(hf):
    config = hf.rag.generator.config
    saved = config.bos_token_id
    try:
        config.bos_token_id = -1  # e.g. a config that marks "none" so
        model = _build(hf)
        assert model.bos_token_id is None
        json.dumps(model.options())
        again = _build(hf, **model.options())  # what is saved loads again
        assert again.options() == model.options()
    finally:
        config.bos_token_id = saved
