"""Open a saved index directory as the Retriever a RagModel trains and answers with.

An index directory is what ``rag-fast index build --out DIR`` writes: ``passages/`` (a
``PassageStore``), ``index/`` (a ``DenseIndex``) and ``manifest.json`` (kind
``rag_fast.index_bundle``: the encoders and checksums). A directory holding only ``passages/``
and ``index/`` (saved with their own ``save``/``create``) is accepted too.

The Retriever gets no tokenizer: RagModel builds the generator inputs from the passage texts
with its own generator tokenizer. Only the public API of ``rag_fast.retrieval`` is used.
"""
from __future__ import annotations

import json
from pathlib import Path

BUNDLE_KIND = "rag_fast.index_bundle"


def read_bundle_manifest(path: str | Path) -> dict | None:
    """The bundle manifest of an index directory, or None when it has none.

    Raises:
        ValueError: a manifest that is not valid JSON or not an index bundle's.
    """
    manifest_path = Path(path) / "manifest.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{manifest_path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != BUNDLE_KIND:
        kind = manifest.get("kind") if isinstance(manifest, dict) else None
        raise ValueError(f"{manifest_path} describes a {kind!r}, expected an index directory "
                         f"({BUNDLE_KIND!r}, as `rag-fast index build` writes)")
    return manifest


def load_retriever(path: str | Path, *, n_docs: int = 5, verify: bool = True):
    """A ``rag_fast.retrieval.Retriever`` over the index directory ``path``.

    Training, evaluation and serving open their index here, so by default every file's
    content is verified: a flipped byte or a NaN written into the stored vectors is an error
    naming the file, not garbage flowing into passage embeddings. The check is a streamed
    SHA-256 of each file (constant memory), measured at about 0.95 s per GiB of index
    directory (~1.05 GiB/s, one core, from the page cache; a cold cache adds the disk's read
    time).

    Args:
        path: an index directory (see the module docstring).
        n_docs: the Retriever's default K (RagModel passes its own ``n_docs`` per call).
        verify: check every file's SHA-256 (default); ``verify=False`` opts out and checks
            the sizes only, for huge indexes whose storage is trusted.
    Raises:
        FileNotFoundError: ``path`` is not a directory, or lacks ``passages/`` or ``index/``.
        ValueError: a manifest of another kind; an index whose dimension differs from the
            encoder the manifest names, or whose size differs from the passage store's.
        rag_fast.retrieval.StorageError: missing, truncated or corrupt files.
    """
    from rag_fast.retrieval import DenseIndex, PassageStore, Retriever
    from rag_fast.retrieval._files import read_manifest

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
    return Retriever(index, store, n_docs=n_docs, progress=False)


__all__ = ["BUNDLE_KIND", "load_retriever", "read_bundle_manifest"]
