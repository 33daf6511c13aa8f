"""Open a saved index directory as the Retriever a RagModel trains and answers with.

An index directory is what ``rag-fast index build --out DIR`` writes: ``passages/`` (a
``PassageStore``), ``index/`` (a ``DenseIndex``) and ``manifest.json`` (kind
``rag_fast.index_bundle``: the encoders and checksums), with ``bm25/`` when built with
``--bm25``. A directory holding only ``passages/`` and ``index/`` (saved with their own
``save``/``create``), and ``bm25/`` (a training run's refreshed ``index/``), is accepted too.

The Retriever gets no tokenizer: RagModel builds the generator inputs from the passage texts
with its own generator tokenizer. Only the public API of ``rag_fast.retrieval`` is used.
"""
from __future__ import annotations

import os
from pathlib import Path

from rag_fast._validation import not_a_file
from rag_fast.retrieval import DenseIndex, PassageStore, Retriever
from rag_fast.retrieval.bundle import BUNDLE_KIND
from rag_fast.retrieval.lexical import BM25_MANIFEST, BM25_PART, BM25Index, load_part
from rag_fast.retrieval.sharded import ShardedIndex, ShardedRetriever
from rag_fast.storage import (OUTPUT_MARKER, REFRESHED_KIND, REFRESHED_PARTS, StorageError,
                              check_seal, folder_kind, part_digests, read_json_file,
                              read_manifest)


def read_bundle_manifest(path: str | Path) -> dict | None:
    """The bundle manifest of an index directory (its seal checked), or None when it has none.

    Raises:
        ValueError: a manifest that is not valid JSON, not an index bundle's, or edited after
            it was written (``rag_fast.retrieval.StorageError``).
    """

    manifest_path = Path(path) / "manifest.json"
    if not os.path.lexists(manifest_path):
        return None
    if manifest_path.is_symlink():
        raise ValueError(f"{manifest_path} is a symbolic link (to "
                         f"{os.readlink(manifest_path)!r}); refused (an index directory's "
                         "manifest is a regular file)")
    if not manifest_path.is_file():
        raise ValueError(f"{manifest_path}: {not_a_file(manifest_path)}; refused (an index "
                         "directory's manifest is a regular file)")
    manifest = read_json_file(manifest_path)  # (ValueError: not a small regular JSON file)
    if not isinstance(manifest, dict) or manifest.get("kind") != BUNDLE_KIND:
        kind = manifest.get("kind") if isinstance(manifest, dict) else None
        raise ValueError(f"{manifest_path} describes a {kind!r}, expected an index directory "
                         f"({BUNDLE_KIND!r}, as `rag-fast index build` writes)")
    return check_seal(manifest_path, manifest, path)


def check_same_encoder(expected: dict | None, found: dict | None, path: str,
                       against: str) -> None:
    """Refuse the index directory ``path`` whose manifest records the encoder ``found`` when
    ``against`` (what it is to replace or stand for) records ``expected``: another encoder
    (name, dimension, pooling, normalisation), or none recorded (a manifest removed, or
    parts saved without one), would give retrieval of another space with no error.

    Raises:
        ValueError: naming ``path``, the first field that differs and both values.
    """
    if expected is None:
        return
    if found is None:
        raise ValueError(f"index {path!r} records no encoder (no manifest.json of `rag-fast "
                         f"index build`), while {against} does ({expected.get('name')!r}); "
                         "refused: build the index with `rag-fast index build`")
    for key in ("name", "dim", "pooling", "normalize"):
        if expected.get(key) != found.get(key):
            raise ValueError(f"index {path!r} was built with another encoder ({key} "
                             f"{found.get(key)!r}, {against} has {expected.get(key)!r})")


def load_retriever(path: str | Path, *, n_docs: int = 5, verify: bool = True,
                   n_docs_from: str | None = None, mode: str = "dense",
                   mode_flag: str = "retrieval mode"):
    """A ``rag_fast.retrieval.Retriever`` over the index directory ``path``.

    Training, evaluation and serving open their index here, so by default every file's
    content is verified: a flipped byte or a NaN written into the stored vectors is an error
    naming the file, not garbage flowing into passage embeddings. The check is a streamed
    SHA-256 of each file (constant memory, one core; its rate is in ``docs/tuning.md``,
    "Verifying files on load"; a cold cache adds the disk's read time).

    Args:
        path: an index directory (see the module docstring).
        n_docs: the Retriever's default K (RagModel passes its own ``n_docs`` per call).
        verify: check every file's SHA-256 (default); ``verify=False`` opts out and checks
            the sizes only, for huge indexes whose storage is trusted.
        n_docs_from: where ``n_docs`` comes from (e.g. a model directory), named in the error
            when it exceeds the index's passage count.
        mode: the Retriever's ``dense``, ``bm25``, ``hybrid`` or ``weighted`` (all but dense
            need the directory's BM25 part, ``rag-fast index build --bm25``, loaded whenever
            present and bound to the passages);
            ``mode_flag``: what set it, named in the error.
    Raises:
        FileNotFoundError: ``path`` is not a directory, or lacks ``passages/`` or ``index/``.
        ValueError: a manifest of another kind; an index whose dimension differs from the
            encoder the manifest names, or whose size differs from the passage store's;
            ``n_docs`` above the index's passage count.
        rag_fast.retrieval.StorageError: missing, truncated or corrupt files.
    """

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"retriever: {str(root)!r} is not a directory (expected an index "
                                "directory from `rag-fast index build`)")
    for part in ("passages", "index"):
        if not (root / part).is_dir():
            raise FileNotFoundError(f"retriever: {str(root)!r} has no {part}/ (expected an index "
                                    "directory from `rag-fast index build`)")
    manifest = read_bundle_manifest(root)
    if manifest is not None:  # its files (the parts' manifests) exist, have their size and checksum
        manifest = read_manifest(root, BUNDLE_KIND, verify=verify)
    dim = manifest["encoder"]["dim"] if manifest and "encoder" in manifest else None
    store = PassageStore.load(root / "passages", verify=verify)
    index = DenseIndex.load(root / "index", verify=verify, expected_dim=dim)
    if n_docs > len(index):
        source = f" (from {n_docs_from})" if n_docs_from else ""
        raise ValueError(f"n_docs={n_docs}{source} is more passages per question than the index "
                         f"{str(root)!r} holds ({len(index)}): use a model with fewer passages "
                         "per question (`rag-fast init --n-docs`) or a larger index")
    if manifest is not None:
        lexical = load_part(root, manifest, len(store), verify=verify)
    else:  # parts without a bundle manifest: a BM25 part only where a marker binds it
        lexical = _bound_part(root, len(store), verify, mode)
    if mode != "dense" and lexical is None:
        raise ValueError(f"{mode_flag} {mode}: index {str(root)!r} has no BM25 part (build it "
                         "with `rag-fast index build --bm25`)")
    return Retriever(index, store, n_docs=n_docs, progress=False, lexical=lexical, mode=mode)


def _bound_part(root: Path, count: int, verify: bool, mode: str):
    """The BM25 part of ``root``, a directory without a bundle manifest, or None. A training
    run's refreshed ``index/`` has a sealed marker recording each part's digest
    (:func:`~rag_fast.training.refresh.export_index_directory`): every part there must be the
    one recorded. A directory without one has no BM25 part that anything binds to its
    passages: its ``bm25/`` is not read (and a mode needing it is refused).

    Raises:
        ValueError, StorageError: a marker edited, a part missing, added or of another build.
    """
    marker = root / OUTPUT_MARKER
    recorded = None
    if folder_kind(root) == REFRESHED_KIND:
        payload = read_json_file(marker)
        if "parts" in payload:  # (a run of an earlier version recorded none: dense only)
            try:
                recorded = check_seal(marker, payload, root)["parts"]
            except StorageError:  # (no reseal for it: training wrote it, nothing else)
                raise StorageError(f"{marker} was changed after training wrote it (its seal "
                                   "does not match its content): restore the run's index/, "
                                   "or train again") from None
    if recorded is None:
        if mode != "dense" and os.path.lexists(root / BM25_PART):
            raise ValueError(f"retrieval mode {mode}: index {str(root)!r} has no manifest.json "
                             f"binding its {BM25_PART}/ to its passages (a directory `rag-fast "
                             "index build --bm25` did not write); build it with that command")
        return None
    present = [name for name in (*REFRESHED_PARTS, BM25_MANIFEST)
               if os.path.lexists(root / name)]
    listed = sorted(recorded) if isinstance(recorded, dict) else recorded
    if not isinstance(recorded, dict) or listed != sorted(present):
        raise StorageError(f"{marker}: its parts {listed!r} are not those {str(root)!r} holds "
                           f"({present}): a part added or removed after training wrote it")
    lexical = None
    if BM25_MANIFEST in recorded:
        if (root / BM25_PART).is_symlink():
            raise ValueError(f"{root / BM25_PART} is a symbolic link; refused (an index "
                             "directory's BM25 part is a folder of its own)")
        lexical = BM25Index.load(root / BM25_PART, verify=verify, expected_count=count)
    for name, digest in part_digests(root, present).items():
        if recorded[name] != digest:
            raise StorageError(f"{root / name} is not the part training wrote in {str(root)!r} "
                               "(it lists other data than its marker recorded): a part of "
                               "another index; restore it, or give an index directory that "
                               "`rag-fast index build` wrote")
    return lexical


def _staged_shard_counts(root: Path) -> list[int]:
    """The ``n`` of every ``embeddings-i-of-n.npy`` in a staging directory (sorted, unique)."""
    import re

    counts = set()
    for p in root.glob("embeddings-*-of-*.npy"):
        m = re.fullmatch(r"embeddings-(\d+)-of-(\d+)\.npy", p.name)
        if m:
            counts.add(int(m.group(2)))
    return sorted(counts)


def load_sharded_retriever(path: str | Path, *, n_docs: int = 5, preset: str = "exact",
                           verify: bool = True, cache: bool = False, group=None, **build_kwargs):
    """A :class:`~rag_fast.retrieval.sharded.ShardedRetriever` over the staging directory
    ``path`` that ``rag-fast index build --out X --shard i/n`` processes leave (``X.staging/``:
    ``key.json``, ``passages/``, ``embeddings-i-of-n.npy``): rank r of the process group
    ``group`` (default: the world) opens shard r and builds its index with ``preset`` (any
    preset or faiss factory string; ``build_kwargs`` go to ``DenseIndex.build``); with
    ``cache`` the built shard index is saved in ``path`` and reused by later runs (see
    ``ShardedIndex.from_shards``).

    Collective: every rank of the group calls it. The number of staged shards must equal the
    group's size; every error is raised on every rank (none is left waiting).

    Raises:
        ValueError: naming ``index.path``: torch.distributed not initialised, not a staging
            directory, a number of shards other than the world size, a missing shard file;
            or ``index.preset``: an unknown preset (from any rank, on every rank).
    """
    import torch.distributed as dist

    root = Path(path)
    if not dist.is_available() or not dist.is_initialized():
        counts = _staged_shard_counts(root) if root.is_dir() else []
        hint = f" with {counts[0]} processes" if len(counts) == 1 else ""
        raise ValueError(f"index.sharded: a sharded index needs torch.distributed: run under "
                         f"torchrun{hint} (one process per shard of {str(root)!r})")
    g = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    error = None
    if not root.is_dir():
        error = (f"index.path: {str(root)!r} is not a directory (expected the staging directory "
                 "that `rag-fast index build --out X --shard i/n` leaves: X.staging)")
    elif not (root / "key.json").is_file():
        error = (f"index.path: {str(root)!r} has no key.json: not a staging directory of "
                 "`rag-fast index build --shard i/n` (sharded: true wants X.staging, not X)")
    else:
        counts = _staged_shard_counts(root)
        if world not in counts:
            staged = (" and ".join(f"{n} shards (embeddings-i-of-{n}.npy)" for n in counts)
                      or "no shards")
            advice = (f"run {counts[0]} processes (torchrun --nproc-per-node {counts[0]}), or "
                      if len(counts) == 1 else "")
            error = (f"index.path: {str(root)!r} holds {staged} but this run has {world} "
                     f"processes (one shard per rank): {advice}stage {world} shards with "
                     f"`rag-fast index build --shard i/{world}`")
    errors: list = [None] * world
    dist.all_gather_object(errors, error, group=g)  # the same verdict on every rank, no hang
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        mine = errors[rank]
        raise ValueError(mine if mine is not None else
                         f"index.path: rank(s) {failed} cannot open their shard: {errors[failed[0]]}")
    try:
        index = ShardedIndex.from_shards(root, preset, group=group, verify=verify, progress=False,
                                         cache=cache, **build_kwargs)
    except ValueError as exc:
        text = str(exc)
        if "preset" in text and "index.preset" not in text:
            text = f"index.preset: {text}"
        raise ValueError(text) from exc
    return ShardedRetriever(index, n_docs=n_docs)


class TimedRetriever:
    """A retriever that adds the wall time of its ``retrieve`` calls to
    ``retrieval_seconds`` (the :class:`~rag_fast.training.Trainer` reports it per step as
    ``retrieval_s``); every other attribute (``store``, ``version``, ``index``, ``swap``...)
    is the wrapped retriever's."""

    def __init__(self, retriever):
        self.__dict__["retriever"] = retriever
        self.__dict__["retrieval_seconds"] = 0.0

    def retrieve(self, *args, **kwargs):
        import time

        start = time.perf_counter()
        try:
            return self.retriever.retrieve(*args, **kwargs)
        finally:
            self.__dict__["retrieval_seconds"] += time.perf_counter() - start

    __call__ = retrieve

    def __getattr__(self, name: str):
        return getattr(self.__dict__["retriever"], name)

    def __setattr__(self, name: str, value) -> None:
        if name == "retrieval_seconds":
            self.__dict__[name] = value
        else:
            setattr(self.retriever, name, value)

    def __repr__(self) -> str:
        return f"TimedRetriever({self.retriever!r})"


__all__ = ["BUNDLE_KIND", "TimedRetriever", "check_same_encoder", "load_retriever",
           "load_sharded_retriever", "read_bundle_manifest"]
