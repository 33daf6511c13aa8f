"""A starting RagModel from a question encoder and a generator given by name or folder.

    build_rag_model(question_encoder="facebook/dpr-question_encoder-single-nq-base",
                    generator="facebook/bart-large", mode="token", n_docs=5)
    build_rag_model(index="kb/", generator="examples/workflow/generator.json",
                    generator_tokenizer="examples/workflow/generator-tokenizer")

The question encoder is any Hugging Face encoder: DPR question encoders give their pooled
vector; other encoders are pooled as their sentence-transformers folder says (MiniLM: mean,
then L2-normalised), else by CLS. ``index=`` takes the question encoder, its pooling and its
normalisation from an index directory (what ``rag-fast index build`` used for questions), so
the questions are embedded as the passages were, and records the index in the model.

The generator is a ``*ForConditionalGeneration`` or a decoder-only ``*ForCausalLM`` (Qwen2,
Llama, GPT-2, ...; docs/decoder_only.md) name or folder with weights, or a JSON config file
(``{"model_type": "bart", "d_model": 256, ...}``, or ``"qwen2"``, ``"llama"``, ``"gpt2"``, ...)
for a generator trained from scratch (random weights, seeded): its vocabulary size and
pad / bos / eos ids come from the generator tokenizer unless the file sets them, and where it
does they must agree with the tokenizer (a vocabulary at least as large, the same ids).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from rag_fast._quiet import quiet_transformers
from rag_fast._validation import brief_error, not_a_file, out_of_memory
from rag_fast.generation.causal import check_causal
from rag_fast.models.family import family_of_config
from rag_fast.models.options import check_arguments
from rag_fast.models.rag_model import RagModel
from rag_fast.models.retriever_io import read_bundle_manifest
from rag_fast.retrieval.encoders import (VOCABULARY_FILES, check_loaded_weights,
                                         check_model_files, check_vocabulary, looks_like_path,
                                         needs_code, sentence_transformers_pooling, unloadable)
from rag_fast.tokenization import verify_tokenizer_folder


def _question_encoder(name: str) -> tuple[torch.nn.Module, Any, str, bool]:
    """(model, tokenizer, pooling, normalize) of a Hugging Face encoder name or folder."""
    import transformers

    check_model_files(name, "question_encoder")
    config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=False)
    if config.model_type == "dpr":  # AutoModel maps every DPR checkpoint to one class
        arch = (config.architectures or ["DPRQuestionEncoder"])[0]
        if arch != "DPRQuestionEncoder":
            raise ValueError(f"question_encoder {name!r} is a {arch}, not a DPRQuestionEncoder")
        model, info = transformers.DPRQuestionEncoder.from_pretrained(
            name, trust_remote_code=False, output_loading_info=True)
    else:
        model, info = transformers.AutoModel.from_pretrained(name, trust_remote_code=False,
                                                             output_loading_info=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    check_vocabulary(tokenizer, "question_encoder", name, "to encode questions with")
    st = (sentence_transformers_pooling(Path(name), "question_encoder") if Path(name).is_dir()
          else None)
    pooling, normalize = st if st else ("cls", False)
    # (a DPR encoder pools with its own output; any other pools its token states)
    check_loaded_weights("question_encoder", name, info,
                         optional=() if config.model_type == "dpr" else ("pooler.",))
    return model, tokenizer, pooling, normalize


def _index_query_encoder(index: str) -> dict:
    manifest = read_bundle_manifest(index)
    if manifest is None or "query_encoder" not in manifest:
        raise ValueError(f"index {index!r} has no manifest.json naming its question encoder "
                         "(expected a directory from `rag-fast index build`)")
    return manifest["query_encoder"]


def _index_size(index: str) -> int | None:
    """Passages in an index directory (its index manifest's count), None when unreadable (the
    loader names what is wrong when the index is opened)."""
    try:
        with open(os.path.join(index, "index", "manifest.json"), encoding="utf-8") as f:
            count = json.load(f).get("count")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return count if isinstance(count, int) else None


def check_n_docs(n_docs: int, index: str | None, name: str = "n_docs") -> None:
    """Refuse more passages per question (``n_docs``) than the index directory ``index``
    holds; ``name``: the argument or flag named in the error."""
    size = _index_size(index) if index is not None else None
    if size is not None and n_docs > size:
        raise ValueError(f"{name}={n_docs} is more passages per question than the index "
                         f"{index!r} holds ({size})")


def _special_ids(tokenizer: Any) -> dict:
    """pad / bos / eos ids of a tokenizer; BERT-style ones use [CLS] and [SEP]."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    pad = tokenizer.pad_token_id
    missing = [n for n, v in (("pad", pad), ("bos/cls", bos), ("eos/sep", eos)) if v is None]
    if missing:
        raise ValueError(f"generator_tokenizer has no {', '.join(missing)} token: a generator "
                         "needs padding, start and end tokens")
    return {"pad_token_id": pad, "bos_token_id": bos, "eos_token_id": eos}


def _check_config_agrees(path: str, values: dict, tokenizer: Any, ids: dict) -> None:
    """A generator config file's own ``vocab_size`` and pad / bos / eos ids, where it sets
    them, against the generator tokenizer's: the tokenizer's every id must have a row in the
    embeddings, and the ids that pad, start and end the answers it encodes must be the ones
    the model pads, starts and stops with. A ValueError naming the file and the key."""
    size = len(tokenizer)
    vocab = values.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)):
        raise ValueError(f"generator config {path}: vocab_size must be an int, got {vocab!r}")
    if vocab is not None and vocab < size:
        raise ValueError(f"generator config {path}: vocab_size {vocab} is smaller than the "
                         f"generator tokenizer's {size} tokens (its ids would fall outside the "
                         f"embeddings); set it to at least {size}, or leave it out to take the "
                         "tokenizer's")
    for key, value in ids.items():
        given = values.get(key)
        if given is None or given == value or (isinstance(given, list) and value in given):
            continue  # (a list of end ids that holds the tokenizer's is fine)
        raise ValueError(f"generator config {path}: {key} {given!r} differs from the generator "
                         f"tokenizer's ({value}); leave it out to take the tokenizer's, or give "
                         "the tokenizer the config was written for")


def _generator_from_config(path: str, tokenizer: Any, seed: int) -> torch.nn.Module:
    import transformers

    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"generator config {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    except RecursionError:
        raise ValueError(f"generator config {path}: nested too deeply to be a config") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"generator config {path}: not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"generator config {path}: expected a JSON object with 'model_type' "
                         "(a transformers config, e.g. \"bart\")")
    values = dict(values)
    model_type = values.pop("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"generator config {path}: model_type {model_type!r} is not a model type "
                         f"transformers {transformers.__version__} knows (e.g. 'bart', 't5', "
                         "'qwen2', 'llama', 'gpt2')")
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except Exception as e:  # transformers' and huggingface_hub's own field checks
        raise ValueError(f"generator config {path}: {brief_error(e)}") from None
    ids = _special_ids(tokenizer)
    _check_config_agrees(path, values, tokenizer, ids)
    for key, value in ids.items():
        if key not in values:
            setattr(config, key, value)
    family = family_of_config(config)
    if "decoder_start_token_id" not in values and not family.decoder_only:
        # answers are trained as [start, tokens..., eos]: decoding starts where training did
        config.decoder_start_token_id = config.bos_token_id
    if "vocab_size" not in values:
        config.vocab_size = len(tokenizer)
    for key in ("forced_bos_token_id", "forced_eos_token_id"):
        if key not in values and hasattr(config, key):
            setattr(config, key, None)
    if family.decoder_only:
        # a decoder-only generator (Llama, Qwen2, GPT-2, ...): the prompt is continued by the
        # answer (docs/decoder_only.md)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(f"generator config {path}: model_type {model_type!r} is neither "
                             "an encoder-decoder model nor a causal LM transformers can build")
    torch.manual_seed(seed)
    auto = getattr(transformers, family.auto_class)
    try:
        return auto.from_config(config)
    except Exception as e:  # sizes the model cannot be built with (e.g. heads not dividing d)
        raise ValueError(f"generator config {path}: transformers cannot build a "
                         f"{model_type!r} model from it: {brief_error(e)}") from None


def _warm_started_generator(name: str, tokenizer: Any, seed: int) -> torch.nn.Module:
    """An encoder-decoder warm-started from the pretrained encoder ``name`` on both sides (the
    BERT2BERT recipe of Rothe et al., 2020, ``transformers.EncoderDecoderModel``): the decoder
    is the encoder's checkpoint as a causal LM with cross-attention added (its new weights,
    and an LM head the checkpoint lacks, drawn with ``seed``); the start, end and pad tokens
    are the tokenizer's (BERT's ``[CLS]``, ``[SEP]``, ``[PAD]``)."""
    import transformers

    check_model_files(name, "generator_from_encoder")
    config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=False)
    if not family_of_config(config).decoder_only:
        raise ValueError(f"generator_from_encoder {name!r} is an encoder-decoder model "
                         f"({type(config).__name__}) already: give it as the generator")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"generator_from_encoder {name!r}: a {config.model_type!r} model cannot "
                         "be a decoder (transformers has no causal LM of that type)")
    ids = _special_ids(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # the encoder side loaded here, as transformers would (an encoder, whatever its config
        # says), so that its loading report is seen: every weight of it must come from the
        # folder (the decoder side reads the same weights and adds only what is new: its
        # cross-attention and an LM head the checkpoint lacks)
        encoder_config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=False)
        encoder_config.is_decoder = encoder_config.add_cross_attention = False
        encoder, info = transformers.AutoModel.from_pretrained(
            name, config=encoder_config, trust_remote_code=False, output_loading_info=True)
        check_loaded_weights("generator_from_encoder", name, info, optional=("pooler.",))
        model = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(
            encoder_model=encoder, decoder_pretrained_model_name_or_path=name,
            decoder_trust_remote_code=False)
    vocab = model.config.decoder.vocab_size
    if vocab < len(tokenizer):
        raise ValueError(f"generator_from_encoder {name!r}: its vocabulary ({vocab}) is smaller "
                         f"than its tokenizer's {len(tokenizer)} tokens")
    # answers are trained as [start, tokens..., end]: decoding starts where training did
    for config in (model.config, model.generation_config):
        config.decoder_start_token_id = ids["bos_token_id"]
        config.bos_token_id = ids["bos_token_id"]
        config.eos_token_id = ids["eos_token_id"]
        config.pad_token_id = ids["pad_token_id"]
    return model


def _check_source(value: str, what: str, config_ok: bool = False) -> None:
    """A model name, folder (or, with ``config_ok``, JSON config) argument that can only be a
    path (see ``looks_like_path``; or a ``.json`` name) and does not exist: a ValueError naming
    ``what`` (the argument or flag) instead of the hub's complaint about the name's form."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_file() and not path.is_dir():  # /dev/zero, a pipe
        raise ValueError(f"{what} {value!r} {not_a_file(path)}: expected a model name, a "
                         "folder holding a transformers model or a JSON config")
    if path.exists():
        return
    if looks_like_path(value) or value.endswith(".json"):
        config = ", or a JSON config for random weights" if config_ok else ""
        raise ValueError(f"{what} {value!r}: no such file or folder (expected a model name, a "
                         f"folder holding a transformers model{config})")


def _loading(what: str, name: str, load):
    """``load()``, its OSError (a name that is neither a folder nor loadable from the hub or
    the local cache) as one ValueError line naming ``what``; torch's warning on a weights
    file's pickle (refused or not) is not shown, so that a refusal is one line."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return load()
    except RecursionError:  # transformers' json.load of a file nested too deeply
        raise ValueError(f"{what} {name!r}: a JSON file of it is nested too deeply to be "
                         "read") from None
    except Exception as e:  # noqa: BLE001  (transformers', safetensors' own failures)
        if isinstance(e, ValueError) and str(e).startswith(f"{what} "):
            raise  # rag_fast's own line, naming what
        if out_of_memory(e) and not Path(name).expanduser().is_dir():
            raise  # (a config built at random: said as such by the command line)
        # transformers' own failure on the files (a config that does not fit the weights, a
        # model type it does not know, code it would have to run, weights too large for the
        # memory or holding a refused pickle): one line naming what
        raise unloadable(what, name, e) from None


# the files a transformers tokenizer is read from (one of them at least, in a folder)
_TOKENIZER_FILES = (VOCABULARY_FILES[0], "tokenizer_config.json", *VOCABULARY_FILES[1:])


def _folder_tokenizer(name: str, what: str) -> Any:
    """``AutoTokenizer.from_pretrained(name)``; from a folder, any failure of the library to
    read its files (a KeyError on a hand-edited tokenizer.json, ...) is one ValueError naming
    ``what`` and the folder."""
    import transformers

    check_model_files(name, what)
    if os.path.isdir(name) and not any(os.path.isfile(os.path.join(name, f))
                                       for f in _TOKENIZER_FILES):
        hint = "" if what == "generator_tokenizer" else ": give --generator-tokenizer"
        raise ValueError(f"{what} {name!r} holds no tokenizer (none of "
                         f"{', '.join(_TOKENIZER_FILES[:3])}, ...){hint}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, trust_remote_code=False)
        tokenizer.all_special_ids  # noqa: B018  (a broken special-token map fails here)
        tokenizer("a b 1")  # (a WordPiece vocabulary without its [UNK] fails here, not later)
    except json.JSONDecodeError as exc:
        if not os.path.isdir(name):
            raise
        raise ValueError(f"{what} {name!r}: a file of it is not valid JSON ({exc})") from None
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001  (the library's error on files it could not read)
        if not os.path.isdir(name) or (isinstance(exc, ValueError) and needs_code(exc)):
            raise
        raise ValueError(f"{what} {name!r}: its files cannot be read as a tokenizer "
                         f"({type(exc).__name__}: {brief_error(exc)})") from None
    check_vocabulary(tokenizer, what, name, "to write answers with")
    return tokenizer


_RAG_HINT = (": a RAG model folder (train it further with `rag-fast train --model`, or give "
             "the generator it was made from)")


def _refuse_rag_folder(name: str) -> None:
    """A RAG model folder given as the generator (its config.json's model_type "rag"), said
    before its tokenizer is looked for (a RAG folder keeps its tokenizers in subfolders)."""
    try:
        with open(os.path.join(name, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        return  # the loaders say what is wrong with it
    if model_type == "rag":
        raise ValueError(f"generator {name!r} is a 'rag' model (RagConfig), no generator "
                         f"transformers can build{_RAG_HINT}")


def _pretrained_generator(name: str, tokenizer: Any) -> torch.nn.Module:
    """A seq2seq or decoder-only generator with weights, by name or folder (the config's
    ``is_encoder_decoder`` decides). A decoder-only one without a pad token gets the
    tokenizer's (or, failing that, its EOS, set on the tokenizer as well)."""
    import transformers

    check_model_files(name, "generator")
    config = transformers.AutoConfig.from_pretrained(name, trust_remote_code=False)
    family = family_of_config(config)
    from transformers.models.auto import modeling_auto

    known = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if family.decoder_only else
             modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if config.model_type not in known:
        raise ValueError(f"generator {name!r} is a {config.model_type!r} model "
                         f"({type(config).__name__}), no {family.name} generator transformers "
                         f"can build{_RAG_HINT if config.model_type == 'rag' else ''}")
    model, info = getattr(transformers, family.auto_class).from_pretrained(
        name, trust_remote_code=False, output_loading_info=True)
    if family.decoder_only:
        if model.config.pad_token_id is None:
            if tokenizer.pad_token_id is None:
                if tokenizer.eos_token is None:
                    raise ValueError(f"generator {name!r} has no pad token and its tokenizer no "
                                     "pad or eos token: a decoder-only generator needs one to pad")
                tokenizer.pad_token = tokenizer.eos_token
            model.config.pad_token_id = int(tokenizer.pad_token_id)
        # what RagModel would refuse, said before the weights' report (an encoder given as the
        # generator lacks an LM head: its head is the reason, not its missing weights)
        check_causal(model)
    check_loaded_weights("generator", name, info)
    return model


def build_rag_model(
    *,
    generator: str | None = None,
    generator_from_encoder: str | None = None,
    question_encoder: str | None = None,
    index: str | None = None,
    generator_tokenizer: str | None = None,
    mode: str = "token",
    n_docs: int = 5,
    epsilon: float = 0.0,
    max_context_length: int = 128,
    max_question_length: int = 64,
    seed: int = 0,
) -> RagModel:
    """A RagModel to start training from (see the module docstring).

    Args:
        generator: a seq2seq or decoder-only (``*ForCausalLM``) model name or folder, or a
            JSON config file (random weights; ``model_type`` "bart", "t5", ... or "qwen2",
            "llama", "gpt2", ...).
        generator_from_encoder: instead of ``generator``, a pretrained encoder's name or folder
            (BERT, MiniLM, ...) to warm-start an encoder-decoder from, on both sides
            (``EncoderDecoderModel``; its tokenizer is the generator's unless
            ``generator_tokenizer`` is given).
        question_encoder: an encoder name or folder; default: the index's question encoder.
        index: an index directory; its question encoder (and pooling) is used unless
            ``question_encoder`` is given, and the model records it for eval / generate.
        generator_tokenizer: tokenizer name or folder (default: the generator's folder; needed
            with a config file).
        mode, n_docs, epsilon, max_context_length, max_question_length: RagModel options.
        seed: the random initialisation of a generator built from a config file.
    Raises:
        ValueError: neither ``question_encoder`` nor ``index``; a config file without
            ``model_type`` or of a model that is neither encoder-decoder nor a causal LM; a
            tokenizer missing special tokens; a
            question encoder whose dimension differs from the index's; ``n_docs`` above the
            number of passages in ``index``.
        OSError: a name or folder that ``transformers`` cannot open.
    """

    # RagModel's own checks, before any model is downloaded or loaded
    check_arguments(mode=mode, n_docs=n_docs, epsilon=epsilon,
                    max_context_length=max_context_length, max_question_length=max_question_length)
    check_n_docs(n_docs, index)
    spec = _index_query_encoder(index) if index is not None else None
    if question_encoder is None:
        if spec is None:
            raise ValueError("give question_encoder (a name or folder) or index (an index "
                             "directory whose question encoder to use)")
        question_encoder = spec["name"]
    if (generator is None) == (generator_from_encoder is None):
        raise ValueError("give exactly one of generator and generator_from_encoder")
    if generator is None:
        _check_source(generator_from_encoder, "generator_from_encoder")
    else:
        _check_source(generator, "generator", config_ok=True)
        if os.path.isdir(generator):
            _refuse_rag_folder(generator)
    if generator_tokenizer is not None:
        _check_source(generator_tokenizer, "generator_tokenizer")
    if question_encoder is not None:
        _check_source(question_encoder, "question_encoder")
    is_config = (generator is not None and os.path.isfile(generator)
                 and generator.endswith(".json"))
    if is_config and generator_tokenizer is None:
        raise ValueError(f"generator {generator!r} is a config file: give generator_tokenizer "
                         "(a tokenizer name or folder) for its vocabulary")
    with quiet_transformers():
        q_model, q_tok, pooling, normalize = _loading(
            "question_encoder", question_encoder, lambda: _question_encoder(question_encoder))
        if spec is not None and spec["name"] == question_encoder:
            pooling = spec.get("pooling", pooling)
            normalize = bool(spec.get("normalize", normalize))
            if pooling == "pooler":  # DPR: the encoder returns its pooled vector itself
                pooling = "auto"
        if spec is not None and "dim" in spec:
            dim = int(getattr(q_model.config, "projection_dim", 0) or q_model.config.hidden_size)
            if dim != int(spec["dim"]):
                raise ValueError(f"question_encoder {question_encoder!r} gives {dim}-d vectors, "
                                 f"the index {index!r} holds {spec['dim']}-d passage vectors")
        tok_name = generator_tokenizer or generator or generator_from_encoder
        tok_what = ("generator_tokenizer" if generator_tokenizer else
                    "generator" if generator else "generator_from_encoder")
        verify_tokenizer_folder(tok_name, tok_what)  # one `tokenizer fit` wrote: unedited
        g_tok = _loading(tok_what, tok_name, lambda: _folder_tokenizer(tok_name, tok_what))
        if generator_from_encoder is not None:
            g_model = _loading("generator_from_encoder", generator_from_encoder,
                               lambda: _warm_started_generator(generator_from_encoder, g_tok,
                                                               seed))
        elif is_config:
            g_model = _generator_from_config(generator, g_tok, seed)
        else:
            g_model = _loading("generator", generator,
                               lambda: _pretrained_generator(generator, g_tok))
    model = RagModel(g_model, q_model, None, mode=mode, n_docs=n_docs,
                     generator_tokenizer=g_tok, question_tokenizer=q_tok, epsilon=epsilon,
                     question_pooling=pooling if pooling in ("cls", "mean") else "auto",
                     normalize_questions=normalize, max_context_length=max_context_length,
                     max_question_length=max_question_length)
    positions = model.max_positions
    if positions is not None and model.family.prompt_positions(max_context_length) >= positions:
        raise ValueError(f"max_context_length {max_context_length} leaves no position for an "
                         f"answer: the {model.family.name} generator has {positions} positions, "
                         f"shared by the prompt and its answer; use at most {positions - 1} "
                         "(less leaves room for longer answers)")
    model.index_path = os.path.abspath(index) if index is not None else None
    return model
