"""What several ``rag-fast`` commands share when they run: the device a ``--device`` names, a
model directory opened for answering, the decoding settings of ``eval`` and ``generate`` (one
set, one default; their options are :func:`rag_fast.cli.parsers.add_decoding_options`), the
checks on counts given as options, and how a warning is said."""
from __future__ import annotations

import argparse
import os
import sys

from rag_fast._jsonl import lone_surrogate
from rag_fast.models.inference import (DEFAULT_BEAMS, DEFAULT_NEW_TOKENS, check_new_tokens,
                                       load_for_inference)
from rag_fast.training.trainer import resolve_device


def check_positive(*options: tuple[str, int]) -> None:
    """Each ``(flag, value)`` at least 1, else a ValueError naming the flag."""
    for flag, value in options:
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def check_text(flag: str, value: str) -> None:
    """Refuse a command-line text that is not valid UTF-8 (Python keeps each bad byte as a
    lone surrogate, which no tokenizer takes), naming ``flag`` and the byte."""
    found = lone_surrogate(value)
    if found is not None:
        _, index, char = found
        code = ord(char)
        what = (f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF
                else f"an encoded surrogate \\u{code:04x}")
        raise ValueError(f"{flag} is not valid UTF-8: {what} at character {index + 1}")


def warn(message: str) -> None:
    """A command's warning: one line on stderr, ``rag-fast: warning: MESSAGE``."""
    print(f"rag-fast: warning: {message}", file=sys.stderr)


def load_model(model_dir: str, index: str | None, device: str | None,
               require_index: bool = True, n_docs: int | None = None,
               retrieval_mode: str = "dense"):
    """A model directory with its retriever (``--index``, else the one the model records; none
    when the model records none and ``require_index`` is False) on ``--device`` (default: CUDA
    when available), retrieving ``--n-docs`` passages per question (None: the model's
    ``n_docs``), by ``--retrieval-mode``, for ``eval`` and ``generate``."""
    device = resolve_device(device, "--device")  # a bad --device fails before the model loads
    return load_for_inference(model_dir, index, device, require_index=require_index,
                              n_docs=n_docs, retrieval_mode=retrieval_mode)


# The one default of `eval` and `generate`: beam search with 4 beams, at most 32 new tokens,
# RAG-Sequence's thorough decoding; sampling and penalties as the model's generation config says
# (as transformers' generate). The same question gets the same answer from both commands.
DEFAULT_DECODING_WORDS = (f"beam search with {DEFAULT_BEAMS} beams and at most "
                          f"{DEFAULT_NEW_TOKENS} new tokens, as `rag-fast eval` and `rag-fast "
                          "generate` both do by default")
_FROM_CONFIG = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                "no_repeat_ngram_size")


def decoding_settings(args: argparse.Namespace, model) -> tuple[dict, dict]:
    """``(settings, record)`` of the decoding options: the keyword arguments of
    ``RagModel.generate`` (``rng`` included when ``--seed`` is given), and the same as plain
    JSON, with the model's generation-config values that apply where an option was not given
    (``"from_generation_config"``), for the outputs to record.

    Raises:
        ValueError: a count below 1, naming the flag.
    """
    check_positive(("--num-beams", args.num_beams), ("--max-new-tokens", args.max_new_tokens))
    _check_sampling_flags(args)
    settings: dict = dict(num_beams=args.num_beams, max_new_tokens=args.max_new_tokens)
    if model.mode == "sequence":
        settings["decoding"] = args.decoding
    for name in _FROM_CONFIG:
        value = getattr(args, name, None)
        if value is not None:  # unset: the model's generation config decides
            settings[name] = value
    record = {"rag_mode": model.mode, **settings}
    if args.seed is not None:
        if not 0 <= args.seed < 2**63:  # torch seeds are 64-bit
            raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
        settings["rng"] = _generator(model.device, args.seed)
        record["seed"] = args.seed
    config = getattr(model, "generation_config", None)
    if config is not None:
        inherited = {k: getattr(config, k) for k in _FROM_CONFIG
                     if k not in settings and getattr(config, k, None) not in (None, False, 0, 1.0)}
        if inherited:
            record["from_generation_config"] = inherited
    return settings, record


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """The sampling and penalty flags given, each in its range whether or not the decoding
    samples (a value that could never apply is a mistake, said now, naming the flag)."""
    import math

    def given(name):
        return getattr(args, name, None)

    if given("temperature") is not None and not 0 < args.temperature < math.inf:
        raise ValueError(f"--temperature must be a finite number > 0, got {args.temperature}")
    if given("top_k") is not None and args.top_k < 0:
        raise ValueError(f"--top-k must be at least 0 (0: off), got {args.top_k}")
    if given("top_p") is not None and not 0 <= args.top_p <= 1:
        raise ValueError(f"--top-p must lie in [0, 1] (1: off), got {args.top_p}")
    if given("repetition_penalty") is not None and not 0 < args.repetition_penalty < math.inf:
        raise ValueError("--repetition-penalty must be a finite number > 0 (1: off), got "
                         f"{args.repetition_penalty}")
    if given("no_repeat_ngram_size") is not None and args.no_repeat_ngram_size < 0:
        raise ValueError("--no-repeat-ngram-size must be at least 0 (0: off), got "
                         f"{args.no_repeat_ngram_size}")


def _generator(device, seed: int):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def describe_decoding(record: dict) -> str:
    """One line for a command's header: ``decoding: beam search, 4 beams, at most 32 new
    tokens (RAG-Token)``, with what the generation config adds."""
    beams = record["num_beams"]
    sampling = record.get("do_sample", record.get("from_generation_config", {}).get("do_sample"))
    search = ("sampling" if sampling else
              "greedy" if beams == 1 else f"beam search, {beams} beams")
    text = (f"decoding: {search}, at most {record['max_new_tokens']} new tokens (RAG-"
            f"{'Sequence ' + record['decoding'] if record['rag_mode'] == 'sequence' else 'Token'})")
    extra = {k: v for k, v in record.items() if k in _FROM_CONFIG and k != "do_sample"}
    extra.update(record.get("from_generation_config", {}))
    if extra:
        text += "; " + ", ".join(f"{k} {v}" for k, v in sorted(extra.items()))
    return text


def said_on_interrupt(paths: list[str], whole: str):
    """What a Ctrl-C says about the output files ``paths`` (each put in place whole by a
    rename, in this order): ``whole`` once every one is this run's (another file than the one
    there when this is called), which of them are when only some are, else that nothing was
    written. For ``args.on_interrupt``, set before the files are written."""
    def identity(path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_ino, st.st_dev, st.st_mtime_ns

    before = [identity(p) for p in paths]

    def said() -> str:
        new = [p for p, b in zip(paths, before) if identity(p) not in (None, b)]
        if len(new) == len(paths):
            return whole
        if new:
            return f"only {', '.join(new)} of this run's outputs were written"
        return "nothing was written at the output path"
    return said


__all__ = ["DEFAULT_BEAMS", "DEFAULT_NEW_TOKENS", "check_new_tokens",
           "check_positive", "check_text", "decoding_settings", "describe_decoding", "load_model",
           "resolve_device", "said_on_interrupt", "warn"]
