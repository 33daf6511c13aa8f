"""Index refresh during training: re-embed the passages with the current encoder every N steps.

``TrainConfig.refresh_index_every = N`` makes the :class:`~rag_fast.training.Trainer` rebuild
the model's passage index after every N-th optimizer step, from passage vectors made by the
model's encoder as trained so far, and swap it into the retriever before the next step:

* **single index** (a :class:`~rag_fast.retrieval.Retriever`, plain or wrapped in
  ``TimedRetriever``): each of the W ranks embeds rows ``[N*r//W, N*(r+1)//W)`` of the
  passage store, the rows are all-gathered, and every rank builds the same index with the
  preset and search settings of the index in use (``DenseIndex.build(vectors, old.preset,
  nprobe=, ef_search=, rerank=)``; the settings a build tuned for a target recall are kept,
  not tuned again), then swaps it in with :meth:`Retriever.swap` (one reference assignment);
* **sharded index** (a :class:`~rag_fast.retrieval.sharded.ShardedRetriever`): each rank
  embeds the rows of its own shard and builds its shard's index; a new
  :class:`~rag_fast.retrieval.sharded.ShardedIndex` is made (collective: its checks run on
  every rank) and swapped in by :meth:`ShardedRetriever.swap` on every rank at the same step.

The vectors are rounded to fp16 before the build, as ``rag-fast index build`` stores them, so
a refreshed index is what a fresh build from the same encoder gives.

Agreement: a failure on any rank (embedding, building, writing) is all-reduced before anything
is swapped, so every rank raises and none keeps searching an index the others have dropped.

Persistence (when ``output_dir`` is set): the new index is written to
``output_dir/index-refresh/step-SSSSSSSS/`` (the sharded one to
``step-SSSSSSSS-shard-i-of-n/``, one per rank) through ``atomic_directory`` (a temporary
sibling renamed into place) **before** the swap, and ``TrainState.refreshed_at`` records the
step. A kill while writing leaves only a temporary directory of a dead process: the index in
memory was never replaced, and the next start removes the temporary. On resume, the index of
the checkpoint's ``refreshed_at`` step is opened (verified) and swapped in; refreshes written
after that checkpoint are removed, and after each checkpoint the refreshes it no longer needs
are removed.

The passage encoder. ``refresh_encoder = "question_encoder"`` (the one choice so far) embeds
``title + ". " + text`` (the text alone without a title, as :class:`Encoder` does for non-DPR
models) with the model's ``question_encoder`` and ``question_tokenizer`` and its pooling and
normalisation (``RagModel.encode_questions``), in eval mode without gradient: a shared
question/passage encoder whose passage side follows the question side's training. A
:class:`~rag_fast.training.Trainer` also accepts ``passage_embedder=``: any
``fn(store, lo, hi) -> [hi - lo, d]`` array (e.g. a separately trained passage encoder).
"""
from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from rag_fast.retrieval.encoders import shard_rows
from rag_fast.retrieval.index import DenseIndex
from rag_fast.retrieval.lexical import BM25_MANIFEST, BM25_PART
from rag_fast.retrieval.sharded import ShardedIndex, ShardedRetriever, comm_device
from rag_fast.storage import (REFRESHED_KIND, REFRESHED_PARTS, atomic_directory, part_digests,
                              remove_leftovers, write_marker)

REFRESH_DIR = "index-refresh"
REFRESH_ENCODERS = ("question_encoder",)
_NAME = re.compile(r"step-(\d{8})(?:-shard-(\d+)-of-(\d+))?")
_LEFTOVER = re.compile(r"\.(step-\d{8}(?:-shard-\d+-of-\d+)?)\.(?:tmp|new|old|trash)-\d+-[0-9a-f]+")

PassageEmbedder = Callable[[object, int, int], np.ndarray]


def question_encoder_embedder(model, *, batch_size: int = 64, max_length: int = 256) -> PassageEmbedder:
    """``fn(store, lo, hi)``: the vectors ``[hi - lo, d]`` float32 of store rows ``[lo, hi)``
    made by ``model``'s question encoder (see the module docstring), in eval mode and without
    gradient; the encoder's train/eval mode is restored afterwards.

    Raises:
        ValueError: the model has no ``question_encoder`` or ``question_tokenizer``.
    """
    if getattr(model, "question_encoder", None) is None or getattr(model, "question_tokenizer", None) is None:
        raise ValueError("refresh_encoder 'question_encoder': the model needs a question_encoder "
                         "and a question_tokenizer to embed the passages")

    def embed(store, lo: int, hi: int) -> np.ndarray:
        encoder = model.question_encoder
        device = next(encoder.parameters()).device
        was_training = encoder.training
        encoder.eval()
        out = []
        try:
            with torch.no_grad():
                for start in range(lo, hi, batch_size):
                    rows = range(start, min(hi, start + batch_size))
                    texts = [f"{store.title(r)}. {store.text(r)}" if store.title(r) else store.text(r)
                             for r in rows]
                    enc = model.question_tokenizer(texts, padding=True, truncation=True,
                                                   max_length=max_length, return_tensors="pt")
                    q = model.encode_questions(enc["input_ids"].to(device),
                                               enc["attention_mask"].to(device))
                    out.append(q.float().cpu().numpy())
        finally:
            encoder.train(was_training)
        dim = out[0].shape[1] if out else 0
        return np.concatenate(out) if out else np.zeros((0, dim), np.float32)

    return embed


def export_index_directory(store, refreshed: str | Path, out: str | Path,
                           lexical=None) -> Path:
    """Write ``out`` (atomically, replacing it): an index directory that ``rag-fast eval`` /
    ``generate`` and ``load_retriever`` open, made of ``store``'s passages (hard links where
    the file system allows, else copies; the tokenisation cache left out), the refreshed
    index ``refreshed`` (an ``index-refresh/step-*`` directory) and, given ``lexical`` (the
    :class:`~rag_fast.retrieval.lexical.BM25Index` trained with, which a refresh leaves as it
    is: the same passages), that part saved as ``bm25/``: the part in memory, not the files
    at the path it was opened from, which may have changed since. No bundle manifest: its
    encoder is the trained model's question encoder, not a Hugging Face encoder by name; each
    part keeps its own sealed manifest, and the folder's marker (``rag_fast-output.json``,
    sealed) records the digest of each part's listed files, so that ``load_retriever``
    refuses a part swapped for another.

    Raises:
        FileNotFoundError: ``refreshed`` is not a directory.
    """
    refreshed = Path(refreshed)
    if not refreshed.is_dir():
        raise FileNotFoundError(f"refresh_index_every: no refreshed index at {str(refreshed)!r}")

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    with atomic_directory(out, overwrite=True, kind=REFRESHED_KIND) as tmp:
        shutil.copytree(store.root, tmp / "passages", ignore=shutil.ignore_patterns("tokens"),
                        copy_function=link_or_copy)
        shutil.copytree(refreshed, tmp / "index", copy_function=link_or_copy)
        parts = list(REFRESHED_PARTS)
        if lexical is not None:
            lexical.save(tmp / BM25_PART)
            parts.append(BM25_MANIFEST)
        # the marker binds the parts (sealed): a part swapped for another is refused on load
        write_marker(tmp, REFRESHED_KIND, seal=True, parts=part_digests(tmp, parts))
    return Path(out)


def _name(step: int, shard: tuple[int, int] | None) -> str:
    return f"step-{step:08d}" + (f"-shard-{shard[0]}-of-{shard[1]}" if shard else "")


def build_like(old, vectors: np.ndarray, meta: dict | None = None):
    """A :class:`DenseIndex` over ``vectors`` with ``old``'s preset, search settings and
    placement of the inverted lists (in RAM or on disk)."""
    settings = {k: old.params[k] for k in ("nprobe", "ef_search", "rerank") if k in old.params}
    # an index whose inverted lists live on disk is rebuilt the same way
    return DenseIndex.build(vectors, old.preset, progress=False, meta=meta,
                            on_disk=bool(getattr(old, "on_disk", False)), **settings)


class IndexRefresher:
    """Re-embeds the passages and swaps the rebuilt index into ``retriever`` (see the module
    docstring). Used by the Trainer; collective when the world size is > 1.

    Args:
        retriever: the model's retriever: a Retriever (or a wrapper forwarding ``index``,
            ``store`` and ``swap``) or a ShardedRetriever.
        embed: ``fn(store, lo, hi) -> [hi - lo, d]`` vectors.
        output_dir: the run's output directory (None: nothing is written, nothing resumes).
        rank, world_size: of the default process group.
    Raises:
        ValueError: naming ``refresh_index_every``: no retriever, or one that cannot swap.
    """

    def __init__(self, retriever, embed: PassageEmbedder, output_dir: str | None, rank: int,
                 world_size: int):
        if retriever is None:
            raise ValueError("refresh_index_every: the model has no retriever to refresh")
        self.sharded = isinstance(retriever, ShardedRetriever)
        if not self.sharded and not (hasattr(retriever, "swap") and hasattr(retriever, "index")
                                     and hasattr(retriever, "store")):
            raise ValueError(f"refresh_index_every: the model's retriever ({type(retriever).__name__}) "
                             "cannot be refreshed (a Retriever or ShardedRetriever is needed)")
        self.retriever, self.embed = retriever, embed
        self.rank, self.world_size = rank, world_size
        self.root = Path(output_dir) / REFRESH_DIR if output_dir else None
        self.current = 0  # the step whose index is in use (0: the one the run started with)

    # ---- helpers -------------------------------------------------------------------------
    def _shard(self) -> tuple[int, int] | None:
        return (self.rank, self.world_size) if self.sharded else None

    def _rows(self) -> tuple[int, int]:
        """The store rows this rank embeds."""
        if self.sharded:
            s = self.retriever.sharded
            return s.offset, s.offset + len(s.index)
        return shard_rows(len(self.retriever.store), (self.rank, self.world_size))

    def _comm_device(self) -> torch.device:
        return comm_device(dist.group.WORLD, None)

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank when ``what`` failed on any rank."""
        failed = error is not None
        if self.world_size > 1:
            flag = torch.tensor([int(failed)], dtype=torch.int64, device=self._comm_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed = bool(flag.item())
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"{what} failed on another rank (see the error there); this rank "
                               "keeps its previous index")

    def _gather(self, local: np.ndarray, count: int) -> np.ndarray:
        """The rows of every rank, in store order (single index, W > 1)."""
        sizes = [shard_rows(count, (r, self.world_size)) for r in range(self.world_size)]
        width = max(hi - lo for lo, hi in sizes)
        device = self._comm_device()
        padded = torch.zeros((width, local.shape[1]), dtype=torch.float16, device=device)
        padded[: len(local)] = torch.from_numpy(local).to(device)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[: hi - lo] for p, (lo, hi) in zip(parts, sizes)]).cpu().numpy()

    def _path(self, step: int) -> Path | None:
        """Where this rank's index refreshed at ``step`` is written (None: no output_dir)."""
        return None if self.root is None else self.root / _name(step, self._shard())

    def _swap(self, local_index, step: int) -> int:
        if not self.sharded:
            version = self.retriever.swap(local_index, self.retriever.store)
        else:
            old = self.retriever.sharded
            new = ShardedIndex(local_index, old.offset, group=old.group, store=old.store,
                               device=old.device, shard=old.shard,
                               meta={**old.meta, "refreshed_at": step})
            version = self.retriever.swap(new)
        self.current = step
        return version

    # ---- the refresh ---------------------------------------------------------------------
    def refresh(self, step: int) -> dict:
        """Re-embed, rebuild, write (``output_dir``) and swap in; returns a record of it
        (``seconds``, ``passages``, ``embedded`` by this rank, the retriever's ``version``)."""
        start = time.perf_counter()
        store = self.retriever.store
        old = self.retriever.index  # this rank's shard when sharded
        lo, hi = self._rows()
        error = vectors = None
        try:
            vectors = np.ascontiguousarray(self.embed(store, lo, hi), dtype=np.float32)
            if vectors.shape != (hi - lo, old.dim):
                raise ValueError(f"refresh_encoder: the passage vectors have shape {vectors.shape}, "
                                 f"the index needs [{hi - lo}, {old.dim}] (another dimension?)")
            if not np.isfinite(vectors).all():
                raise ValueError("refresh_encoder: the passage vectors contain NaN or inf")
            vectors = vectors.astype(np.float16)  # as `rag-fast index build` stores them
        except Exception as exc:
            error = exc
        self._agree(error, f"embedding the passages for the refresh at step {step}")
        if not self.sharded and self.world_size > 1:
            vectors = self._gather(vectors, len(store))
        error = index = None
        try:
            meta = {**{k: v for k, v in old.meta.items() if k not in ("refreshed_at", "shard_cache")},
                    "refreshed_at": step}
            index = build_like(old, vectors, meta)
            path = self._path(step)
            if path is not None and (self.sharded or self.rank == 0):
                index.save(path, overwrite=True)
        except Exception as exc:
            error = exc
        self._agree(error, f"rebuilding the index at step {step}")
        version = self._swap(index, step)
        return {"seconds": round(time.perf_counter() - start, 6), "passages": len(store),
                "embedded": hi - lo, "version": version}

    # ---- resume and clean-up -------------------------------------------------------------
    def restore(self, step: int) -> None:
        """Swap in the index refreshed at ``step`` (a resumed checkpoint's ``refreshed_at``),
        read from ``output_dir``. Collective when W > 1.

        Raises:
            ValueError: on every rank, naming the directory: it is missing or not the index of
                that step (the run's ``index-refresh/`` was removed or changed).
        """
        error = index = None
        try:
            path = self._path(step)
            if path is None:
                raise ValueError("refresh_index_every: the checkpoint uses an index refreshed at "
                                 f"step {step} but output_dir is not set")
            old = self.retriever.index
            if not path.is_dir():
                raise ValueError(f"refresh_index_every: the checkpoint uses the index refreshed at "
                                 f"step {step}, but {str(path)!r} is missing; restore it or train "
                                 "from scratch")
            index = DenseIndex.load(path, verify=True, expected_dim=old.dim)
            if index.meta.get("refreshed_at") != step or len(index) != len(old):
                raise ValueError(f"refresh_index_every: {str(path)!r} is not the index refreshed at "
                                 f"step {step} for this corpus ({len(index)} passages, refreshed at "
                                 f"{index.meta.get('refreshed_at')!r})")
        except Exception as exc:
            error = exc
        self._agree(error, f"opening the index refreshed at step {step}")
        self._swap(index, step)

    def _entries(self) -> list[tuple[int, Path]]:
        """(step, path) of this rank's refreshed index directories."""
        if self.root is None or not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _NAME.fullmatch(p.name)
            if m is None:
                continue
            shard = (int(m.group(2)), int(m.group(3))) if m.group(2) else None
            if shard == self._shard():
                out.append((int(m.group(1)), p))
        return out

    def prune(self, keep: int, *, after: bool) -> None:
        """Remove this rank's refreshed indexes other than step ``keep`` that are older
        (``after=False``: after a checkpoint) or also newer (``after=True``: at the start of
        a run, where they belong to steps after its checkpoint), and the temporaries of dead
        writers (a kill during a refresh)."""
        if self.root is None or (not self.sharded and self.rank != 0) or not self.root.is_dir():
            return
        for step, path in self._entries():
            if step < keep or (after and step > keep):
                shutil.rmtree(path, ignore_errors=True)
        for p in self.root.iterdir():
            m = _LEFTOVER.fullmatch(p.name)
            if m:
                remove_leftovers(self.root / m.group(1))
