"""Encoders: any Hugging Face encoder turned into passage and question embeddings.

Pooling is CLS, mean over real tokens, or DPR's pooler output; ``"auto"`` reads a
sentence-transformers pooling config when the model folder has one (MiniLM: mean, then L2
normalisation), uses the pooler for DPR checkpoints and CLS otherwise. Passage encoding sorts
each shard by length so batches carry little padding, runs in fp16 (or bf16) on a GPU, and
writes an fp16 ``.npy`` (allocated on disk before encoding, written atomically) for rows
``[N*i/n, N*(i+1)/n)`` of shard ``i`` of ``n``, so many processes or machines can encode one
corpus.
"""
from __future__ import annotations

import errno
import io
import json
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_fast._validation import brief_error, not_a_file, out_of_memory
from rag_fast.storage import MAX_JSON_FILE_BYTES, atomic_file, no_space, reserve_space
from rag_fast.retrieval.passages import PassageStore

POOLINGS = ("auto", "cls", "mean", "pooler")
TOKENIZE_CHARS = 1 << 22  # characters of text per tokenizer call (Encoder._tokenize)


def parse_shard(shard: str | tuple[int, int] | None) -> tuple[int, int]:
    """``"i/n"`` or ``(i, n)`` -> ``(i, n)`` with ``0 <= i < n``; None -> ``(0, 1)``.

    Raises:
        ValueError: naming ``shard`` and the expected form.
    """
    if shard is None:
        return 0, 1
    try:
        i, n = (int(v) for v in (shard.split("/") if isinstance(shard, str) else shard))
    except (ValueError, TypeError):
        raise ValueError(f"shard must look like 'i/n' (shard i of n, 0-based), got {shard!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"shard must satisfy 0 <= i < n, got i={i}, n={n}")
    return i, n


def shard_rows(count: int, shard: tuple[int, int]) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of shard ``i`` of ``n`` over ``count`` rows (contiguous, balanced)."""
    i, n = shard
    return count * i // n, count * (i + 1) // n


def sentence_transformers_pooling(path: Path, what: str = "encoder") -> tuple[str, bool] | None:
    """(pooling, normalize) from a sentence-transformers folder, or None if it is not one (it
    has no ``modules.json``).

    Raises:
        ValueError: naming ``what`` (the argument or flag), the folder and the file, for a
            ``modules.json`` or pooling config that is not a regular file within its limit, not
            JSON of the shape sentence-transformers writes, or a module path out of the folder.
    """
    listing = path / "modules.json"
    if not os.path.lexists(listing):
        return None
    modules = _settings_json(listing, path, what)
    if not isinstance(modules, list) or not all(
            isinstance(m, dict) and isinstance(m.get("type", ""), str)
            and isinstance(m.get("path", ""), str) for m in modules):
        raise ValueError(f"{what} {str(path)!r}: its modules.json is not a list of modules "
                         "with a string \"type\" and \"path\" (as sentence-transformers writes)")
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    pooling = "cls"
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            config = path / m.get("path", "") / "config.json"
            inside = os.path.realpath(path) + os.sep
            if not os.path.realpath(config).startswith(inside):
                raise ValueError(f"{what} {str(path)!r}: its modules.json names a pooling "
                                 f"module out of the folder ({m.get('path')!r})")
            cfg = _settings_json(config, path, what) if os.path.lexists(config) else {}
            if not isinstance(cfg, dict):
                raise ValueError(f"{what} {str(path)!r}: {config.relative_to(path)} is not a "
                                 "JSON object")
            pooling = "mean" if cfg.get("pooling_mode_mean_tokens") else "cls"
    return pooling, normalize


def _settings_json(file: Path, folder: Path, what: str):
    """A settings file of a model folder, read only as a regular file within the limit of
    :data:`MAX_JSON_FILE_BYTES` (a pipe would block, a huge sparse file fill the memory)."""
    shown = file.relative_to(folder)
    _check_file(file, MAX_JSON_FILE_BYTES, f"{what} {str(folder)!r}: its {shown}")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} {str(folder)!r}: its {shown} is not valid JSON "
                         f"({brief_error(e, 120)})") from None


# the files transformers reads a model's settings and its tokenizer from, and the most bytes
# each may hold: a settings file is JSON of a few kB (the bound of rag_fast's own manifests); a
# tokenizer's vocabulary tens of MB at most (Gemma's tokenizer.json, the largest in use, is
# about 33 MB)
SETTINGS_FILES = ("config.json", "generation_config.json", "tokenizer_config.json",
                  "special_tokens_map.json", "added_tokens.json", "modules.json",
                  "sentence_bert_config.json", "model.safetensors.index.json",
                  "pytorch_model.bin.index.json")
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer.model", "source.spm")
MAX_VOCABULARY_FILE_BYTES = 256 << 20
# the weight files transformers reads, and the indexes that list a split model's files
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000  # the safetensors library's own bound
# added and special tokens a tokenizer's files may list: loading them takes time growing with
# the square of their count (300,000 took minutes); real tokenizers list up to a few thousand
MAX_ADDED_TOKENS = 10_000
_ADDED_TOKENS = (("special_tokens_map.json", ("additional_special_tokens",)),
                 ("tokenizer_config.json", ("additional_special_tokens", "added_tokens_decoder",
                                            "extra_special_tokens")),
                 ("added_tokens.json", None), ("tokenizer.json", ("added_tokens",)))


def check_model_files(name: str, what: str) -> None:
    """A model folder's settings, tokenizer and weight files (those present, and those a
    split model's index lists), before transformers reads any: each a regular file (a pipe,
    a device or a link to nothing in place of one is skipped by transformers without a word,
    and a tokenizer then falls back to its special tokens alone, or blocks on opening it), a
    settings or tokenizer file of at most its bound (a huge sparse file is refused, never read
    whole), a safetensors file whose header promises the bytes it holds (never mapped whole
    when it is zeros or cut short).
    A ValueError naming ``what`` (the argument or flag), the folder and the file; a name that
    is not a folder (a model name) is left to the loaders."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return
    for file in SETTINGS_FILES + VOCABULARY_FILES:
        if os.path.lexists(folder / file):
            _check_file(folder / file, MAX_JSON_FILE_BYTES if file in SETTINGS_FILES else
                        MAX_VOCABULARY_FILE_BYTES, f"{what} {name!r}: its {file}")
    for file, listed_in in _weight_files(folder, what, name):
        said = f"{what} {name!r}: its {file}" + (f" (listed in its {listed_in})"
                                                  if listed_in else "")
        if os.path.lexists(folder / file):
            _check_file(folder / file, 1 << 62, said)
            if file.endswith(".safetensors"):
                _check_safetensors(folder / file, said)
            elif not zipfile.is_zipfile(folder / file):
                raise ValueError(f"{said} is not a zip archive as torch.save writes one (an "
                                 "old-format or crafted pickle); refused unread (safetensors "
                                 "weights are read instead when present)")
    _check_added_tokens(folder, what, name)


def _check_added_tokens(folder: Path, what: str, name: str) -> None:
    """At most :data:`MAX_ADDED_TOKENS` added or special tokens in each tokenizer file."""
    for file, keys in _ADDED_TOKENS:
        if not os.path.lexists(folder / file):
            continue
        if file == "tokenizer.json":  # a vocabulary file, within its bound (checked above)
            try:
                data = json.loads((folder / file).read_bytes())
            except (ValueError, RecursionError):
                continue  # transformers says what is wrong with it
        else:
            data = _settings_json(folder / file, folder, what)
        if not isinstance(data, dict):
            continue
        for key, value in ([(k, data.get(k)) for k in keys] if keys else [(None, data)]):
            if isinstance(value, (list, dict)) and len(value) > MAX_ADDED_TOKENS:
                where = f"its {file}" + (f" ({key})" if key else "")
                raise ValueError(f"{what} {name!r}: {where} lists {len(value):,} added or "
                                 f"special tokens, more than a tokenizer ever holds (at most "
                                 f"{MAX_ADDED_TOKENS:,}); refused (loading them would take "
                                 "minutes)")


def _weight_files(folder: Path, what: str, name: str) -> list[tuple[str, str | None]]:
    """The weight files transformers may open in ``folder``: ``(file, the index listing it or
    None)``; an index's ``weight_map`` must map tensor names to relative file names that stay
    in the folder."""
    files: list[tuple[str, str | None]] = [(file, None) for file in WEIGHT_FILES]
    for index in WEIGHT_INDEXES:
        if not os.path.lexists(folder / index):
            continue
        weight_map = _settings_json(folder / index, folder, what)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and v and not os.path.isabs(v)
                and not os.path.normpath(v).startswith("..") for v in weight_map.values()):
            raise ValueError(f"{what} {name!r}: its {index} has no weight_map of file names "
                             "inside the folder (a mapping of tensor names to files such as "
                             "model-00001-of-00002.safetensors)")
        files += [(file, index) for file in sorted(set(weight_map.values()))]
    return files


def _check_safetensors(path: Path, said: str) -> None:
    """A safetensors file whose header is whole and promises exactly the bytes the file
    holds, read before the library maps the file (a file of zeros, or one cut short, would
    otherwise be mapped whole); a ValueError starting with ``said`` otherwise."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= length <= min(MAX_SAFETENSORS_HEADER_BYTES, size - 8):
            raise ValueError(f"{said} is not a safetensors file: its first 8 bytes give a "
                             f"header of {length:,} bytes in a file of {size:,}")
        try:
            header = json.loads(f.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items()
                       if key != "__metadata__"), default=0)
            if not isinstance(end, int):
                raise TypeError(f"offset {end!r}")
        except (ValueError, RecursionError, TypeError, KeyError, IndexError, AttributeError) \
                as e:
            raise ValueError(f"{said} is not a safetensors file: its header does not list "
                             f"tensors ({brief_error(e, 80)})") from None
    if 8 + length + end != size:
        raise ValueError(f"{said} is damaged: its header promises {8 + length + end:,} bytes "
                         f"but the file holds {size:,} (cut short or extended, or not its "
                         "own header)")


def _check_file(path: Path, bound: int, said: str) -> None:
    """``path`` a regular file of at most ``bound`` bytes, else a ValueError starting with
    ``said`` (what names the file: the flag, the folder and the file's name)."""
    if not path.is_file():
        why = "is a link to nothing" if not path.exists() else not_a_file(path)
        raise ValueError(f"{said} {why}")
    size = path.stat().st_size
    if size > bound:
        raise ValueError(f"{said} has {size:,} bytes, more than such a file ever holds (at "
                         f"most {bound:,}); refused unread")


def check_vocabulary(tokenizer, what: str, name: str, use: str) -> None:
    """A tokenizer that holds words beside its special tokens: a folder whose vocabulary file
    is missing or empty loads as its special tokens alone, and every text would then encode
    as ``[UNK]``. ``use``: what the vocabulary is for, said in the error."""
    specials = len(set(tokenizer.all_special_ids))
    if len(tokenizer) <= specials:
        raise ValueError(f"{what} {name!r}: its tokenizer holds only its {specials} special "
                         f"tokens, no vocabulary {use} (is its vocabulary file missing or "
                         "empty?)")


def check_loaded_weights(what: str, name: str, info: dict, optional: Sequence[str] = ()) -> None:
    """transformers' loading report (``from_pretrained(..., output_loading_info=True)``) of
    a pretrained model: every weight its config needs came from its files. transformers draws
    a missing one at random and goes on; rag_fast refuses the folder, naming ``what``, the
    count and the first missing weights. ``optional``: name parts of weights the use at hand
    never reads (an encoder's pooler where it pools otherwise)."""
    missing = sorted(k for k in info.get("missing_keys", ())
                     if not any(part in k for part in optional))
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(f"{what} {name!r}: its weights lack {len(missing)} tensor(s) its config "
                         f"needs ({shown}); transformers would draw them at random, so the "
                         "folder is refused (a damaged download, or weights saved under other "
                         "names?)")


def looks_like_path(name: str) -> bool:
    """A name that can only be a folder: a model name is "name" or "org/name"."""
    return name.startswith((".", "/", "~", "\\")) or name.count("/") > 1 or "\\" in name


def _encoder_config(name: str):
    """The encoder's ``transformers`` config, or a ValueError that says what ``name`` was taken
    for (a folder, a model name) and why it did not load."""
    import transformers

    path = Path(name).expanduser()
    if not path.exists() and looks_like_path(name):
        raise ValueError(f"encoder {name!r}: no such folder (expected a folder holding a "
                         "transformers model, e.g. config.json and its weights, or a model name)")
    if path.is_dir() and not os.path.lexists(path / "config.json"):
        raise ValueError(f"encoder {name!r}: the folder has no config.json (expected a folder "
                         "holding a transformers model)")
    check_model_files(name, "encoder")
    try:
        return transformers.AutoConfig.from_pretrained(name, trust_remote_code=False)
    except RecursionError:
        raise ValueError(f"encoder {name!r}: its config.json is JSON nested too deeply to be "
                         "read") from None
    except (OSError, ValueError, KeyError) as e:  # not on the hub, offline and not cached, a bad name
        raise unloadable("encoder", name, e) from None


def needs_code(exc: BaseException) -> bool:
    """Whether ``transformers`` refused to load something because it needs its own Python code
    (an ``auto_map``), which rag_fast never runs (``trust_remote_code=False``)."""
    return isinstance(exc, ValueError) and "trust_remote_code" in str(exc)


def _chain(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _weights_bytes(folder: Path) -> int:
    return sum((folder / f).stat().st_size for f in WEIGHT_FILES + tuple(
        v for index in WEIGHT_INDEXES if (folder / index).is_file()
        for v in set((json.loads((folder / index).read_text()).get("weight_map") or {})
                     .values())) if (folder / f).is_file())


def unloadable(what: str, name: str, exc: BaseException) -> ValueError:
    """The one-line error for a model ``name`` (given as ``what``) that did not load: one that
    needs its own code, weights too large for the memory or holding other objects than
    tensors, a folder that does not load, or a name that is not a folder and did not load by
    name (not on the hub, or offline and not in the local cache)."""
    if any(isinstance(e, pickle.UnpicklingError) for e in _chain(exc)):
        return ValueError(f"{what} {name!r}: its weights hold something other than tensors and "
                          "plain data, refused by torch's safe loading (nothing in them was "
                          "run)")
    if Path(name).expanduser().is_dir() and any(
            out_of_memory(e) or getattr(e, "errno", None) == errno.ENOMEM
            or "Cannot allocate memory" in str(e) for e in _chain(exc)):
        try:
            size = f" ({_weights_bytes(Path(name).expanduser()) / 2**30:.1f} GiB)"
        except (OSError, ValueError, AttributeError):
            size = ""
        return ValueError(f"{what} {name!r}: its weights{size} do not fit in this process's "
                          f"memory ({brief_error(exc, 120)}): use a machine with more memory, "
                          "a higher memory limit (ulimit -v) or a smaller model")
    if needs_code(exc):
        return ValueError(f"{what} {name!r}: it needs its own Python code to load (an auto_map "
                          "naming a .py file), and rag_fast never runs code from a model folder "
                          "or the hub; refused")
    if Path(name).expanduser().is_dir():
        return ValueError(f"{what} {name!r}: the folder does not load as a transformers model: "
                          f"{brief_error(exc)}")
    offline = os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "TRUE", "yes")
    hint = (" (HF_HUB_OFFLINE is set: only models already in the local cache load by name)"
            if offline else "")
    return ValueError(f"{what} {name!r}: not a model folder, and no model of that name could be "
                      f"loaded{hint}: {brief_error(exc)}")


class Encoder:
    """A Hugging Face encoder with pooling: texts -> ``[N, d]`` embeddings.

    Args:
        name_or_path: model name or local folder (``AutoModel``/``AutoTokenizer``; DPR context
            and question encoders are recognised).
        pooling: ``"auto" | "cls" | "mean" | "pooler"``.
        normalize: L2-normalise embeddings; None -> the sentence-transformers config, else False.
        max_length: tokens per text (longer texts are truncated).
        device: torch device; None -> CUDA when available, else CPU.
        dtype: model dtype on a GPU (``torch.float16`` default, or ``torch.bfloat16``); the
            CPU always runs fp32.

    Raises:
        ValueError: an unknown ``pooling`` or a bad ``max_length``; a name that is neither a
            model folder nor a model name ``transformers`` can load (offline: not in the local
            cache), saying which.
    """

    def __init__(
        self,
        name_or_path: str,
        pooling: str = "auto",
        normalize: bool | None = None,
        max_length: int = 256,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        import transformers

        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        self.name = str(name_or_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            dtype = torch.float32
        elif dtype is None:
            dtype = torch.float16
        config = _encoder_config(self.name)
        self.is_dpr = config.model_type == "dpr"
        if self.is_dpr:  # AutoModel maps every DPR checkpoint to the question encoder.
            arch = (config.architectures or ["DPRQuestionEncoder"])[0]
            model_cls = getattr(transformers, arch)
        else:
            model_cls = transformers.AutoModel
        st = (sentence_transformers_pooling(Path(name_or_path)) if Path(name_or_path).is_dir()
              else None)
        if pooling == "auto":
            pooling = "pooler" if self.is_dpr else (st[0] if st else "cls")
        try:  # the library's failure on the folder's files (a damaged safetensors, ...)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path,
                                                                         trust_remote_code=False)
            with warnings.catch_warnings():  # torch's on a pickle: a refusal is one line
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                model, info = model_cls.from_pretrained(name_or_path, trust_remote_code=False,
                                                        output_loading_info=True)
        except Exception as e:  # noqa: BLE001  (out of memory too: said naming the folder)
            raise unloadable("encoder", name_or_path, e) from None
        check_vocabulary(self.tokenizer, "encoder", self.name, "to encode texts with")
        check_loaded_weights("encoder", self.name, info,
                             optional=() if pooling == "pooler" else ("pooler.",))
        self.model = model.to(self.device, dtype).eval()
        self.pooling = pooling
        self.normalize = bool(st[1]) if normalize is None and st else bool(normalize)
        positions = getattr(config, "max_position_embeddings", None)
        if isinstance(positions, int) and max_length > positions:
            raise ValueError(f"max_length {max_length} is more tokens than encoder {self.name!r} "
                             f"has positions ({positions}); use at most {positions}")
        self.max_length = max_length
        self.dim = int(getattr(config, "projection_dim", 0) or config.hidden_size)

    def describe(self) -> dict:
        """What a saved index records about the encoder that built it."""
        return {"name": self.name, "pooling": self.pooling, "normalize": self.normalize,
                "max_length": self.max_length, "dim": self.dim}

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Pooled embeddings of tokenised inputs ``[B, L]`` -> ``[B, d]`` in the model dtype
        (differentiable: use this to train the question encoder)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        if self.pooling == "pooler":
            pooled = out.pooler_output
        elif self.pooling == "mean":
            mask = attention_mask.unsqueeze(-1).to(out.last_hidden_state.dtype)  # [B, L, 1]
            pooled = (out.last_hidden_state * mask).sum(1) / mask.sum(1).clamp_min(1)
        else:
            pooled = out.last_hidden_state[:, 0]
        return torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled

    def _tokenize(self, texts: Sequence[str], titles: Sequence[str] | None) -> dict:
        """``input_ids`` and ``attention_mask`` ``[B, L]`` of a batch, padded to its longest.

        The tokenizer reads every character of a text before it truncates, and holds tens of
        bytes per character meanwhile; so a batch of long texts is tokenized in calls of at
        most :data:`TOKENIZE_CHARS` characters (one text at least) and padded once, which
        gives the tensors one call gives (64 texts of a million characters made the
        tokenizers library abort under a 4 GB address-space limit)."""
        if titles is not None and self.is_dpr:  # DPR encodes (title, text) as a text pair.
            pairs, kwargs = (list(titles), list(texts)), {"truncation": "only_second"}
        else:
            if titles is not None:
                texts = [f"{t}. {x}" if t else x for t, x in zip(titles, texts)]
            pairs, kwargs = (list(texts),), {"truncation": True}
        kwargs["max_length"] = self.max_length
        sizes = [sum(len(part[i]) for part in pairs) for i in range(len(pairs[0]))]
        if sum(sizes) <= TOKENIZE_CHARS:
            enc = self.tokenizer(*pairs, padding=True, return_tensors="pt", **kwargs)
        else:
            ids, masks, start = [], [], 0
            while start < len(sizes):
                stop, total = start + 1, sizes[start]
                while stop < len(sizes) and total + sizes[stop] <= TOKENIZE_CHARS:
                    total += sizes[stop]
                    stop += 1
                part = self.tokenizer(*(p[start:stop] for p in pairs), **kwargs)
                ids += part["input_ids"]
                masks += part["attention_mask"]
                start = stop
            enc = self.tokenizer.pad({"input_ids": ids, "attention_mask": masks}, padding=True,
                                     return_tensors="pt")
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    @torch.no_grad()
    def encode(
        self,
        texts: Sequence[str],
        titles: Sequence[str] | None = None,
        batch_size: int = 64,
        progress: bool = False,
    ) -> torch.Tensor:
        """Encode texts (and optional titles) -> ``[N, d]`` float32 on the CPU, in input order.

        Texts are encoded longest first so each batch pads little.

        Raises:
            ValueError: empty ``texts``, titles of another length, a bad ``batch_size``.
        """
        if len(texts) == 0:
            raise ValueError("texts must contain at least one text")
        if titles is not None and len(titles) != len(texts):
            raise ValueError(f"titles must have one entry per text ({len(texts)}), got {len(titles)}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        order = np.argsort([-len(t) for t in texts], kind="stable")
        out = torch.empty(len(texts), self.dim, dtype=torch.float32)
        for start in tqdm(range(0, len(texts), batch_size), desc="encoding", disable=not progress):
            rows = order[start : start + batch_size]
            enc = self._tokenize([texts[i] for i in rows], None if titles is None else [titles[i] for i in rows])
            out[torch.from_numpy(rows)] = self.embed(**enc).float().cpu()
        return out

    def encode_queries(self, questions: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        """Question embeddings ``[B, d]`` float32 on the CPU (no gradient)."""
        if isinstance(questions, str):
            raise ValueError("questions must be a list of strings, got a single str")
        return self.encode(questions, batch_size=batch_size)


def _npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The header of a C-order ``.npy`` file of ``shape`` and ``dtype`` (format 1.0, or 2.0
    when the header needs it), padded so that the data is aligned as numpy writes it."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": tuple(int(n) for n in shape)}
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:  # a header of 64 KiB or more
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


def _write_rows(fd: int, offset: int, row_bytes: int, rows: np.ndarray, values: np.ndarray) -> None:
    """Write ``values[j]`` at row ``rows[j]`` of the data starting at ``offset`` (ordinary
    writes, consecutive rows joined into one write)."""
    order = np.argsort(rows, kind="stable")
    rows, values = rows[order], values[order]
    start = 0
    for stop in range(1, len(rows) + 1):
        if stop == len(rows) or rows[stop] != rows[stop - 1] + 1:
            data = np.ascontiguousarray(values[start:stop]).tobytes()
            position = offset + int(rows[start]) * row_bytes
            while data:
                written = os.pwrite(fd, data, position)
                data, position = data[written:], position + written
            start = stop


def encode_passages(
    encoder: Encoder,
    store: PassageStore,
    out: str | Path,
    shard: str | tuple[int, int] | None = None,
    batch_size: int = 64,
    progress: bool = True,
) -> Path:
    """Encode shard ``i`` of ``n`` of ``store`` into an fp16 ``.npy`` at ``out`` (atomically).

    The file holds ``[hi - lo, d]`` float16 for store rows ``[lo, hi)`` (see :func:`shard_rows`);
    concatenating the shards in order gives the embeddings of the whole store. Batches are
    length-sorted within the shard; the rows are written back in store order.

    The whole file is allocated on disk before the first passage is encoded
    (:func:`reserve_space`) and written with ordinary writes into a temporary file beside
    ``out``, renamed into place when complete: a disk without room fails at once with one
    :class:`NoSpaceError` naming ``out``, the bytes it needs and the bytes free, and the
    temporary file is removed on every way out.

    Returns:
        ``out`` as a Path.
    Raises:
        ValueError: an empty shard, a ``batch_size`` below 1.
        NoSpaceError: the disk (or the quota) has no room for the file.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    i, n = parse_shard(shard)
    lo, hi = shard_rows(len(store), (i, n))
    if hi <= lo:
        raise ValueError(f"shard {i}/{n} of a {len(store)}-passage store is empty; use fewer shards")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = _npy_header((hi - lo, encoder.dim), np.float16)
    row_bytes = encoder.dim * 2
    needed = len(header) + (hi - lo) * row_bytes
    try:  # (the temporary is removed before the free space is read for the message)
        with atomic_file(out, "wb", hidden=True) as f:
            fd = f.fileno()  # rows are written in place (pwrite), longest passages first
            reserve_space(fd, out, needed)
            os.pwrite(fd, header, 0)
            order = lo + np.argsort(-store.text_lengths()[lo:hi], kind="stable")
            bar = tqdm(total=hi - lo, desc=f"encoding shard {i}/{n}", unit=" psg", disable=not progress)
            with torch.no_grad():
                for start in range(0, len(order), batch_size):
                    rows = order[start : start + batch_size]
                    enc = encoder._tokenize([store.text(r) for r in rows], [store.title(r) for r in rows])
                    values = encoder.embed(**enc).float().cpu().numpy().astype(np.float16)
                    _write_rows(fd, len(header), row_bytes, rows - lo, values)
                    bar.update(len(rows))
            bar.close()
    except OSError as exc:
        raise no_space(exc, out, needed) from None
    return out
