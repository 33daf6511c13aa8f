"""Fixtures of the safety suite: one small real workflow (a tiny encoder, an index directory, a
model directory, a training config), built once through the ``rag-fast`` command and copied
by the tests that change it."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import faiss
import pytest

from rag_fast import storage

from utils import IN_CI, save_tiny_bert

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "examples" / "workflow" / "generator-tokenizer"
WORDS = ["paris", "seine", "river", "city", "capital", "france", "rome", "tiber", "what", "which",
         "is", "on", "the", "of", "lies"]
GENERATOR = {"model_type": "bart", "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
             "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
             "decoder_ffn_dim": 32, "max_position_embeddings": 128}


def run_cli(*args: str) -> tuple[int, str]:
    """``rag-fast ARGS`` in this process: (exit status, what it printed on stderr)."""
    import contextlib
    import io

    from rag_fast import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return code, err.getvalue()


TESTS = REPO / "tests"


def start_command(*args, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """``rag-fast ARGS`` as a process, as a user runs it: the installed script beside this
    Python, started in the tests folder (so that it imports the installed rag_fast)."""
    script = Path(sys.executable).parent / "rag-fast"
    assert script.is_file(), f"no rag-fast script beside {sys.executable}: install the package"
    return subprocess.Popen([str(script), *map(str, args)], cwd=TESTS, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # (offline: a name that is no folder fails at once, not after
                            # the hub's retries)
                            env={"HF_HUB_OFFLINE": "1", **os.environ, **(env or {})}, **kwargs)


def build_with_memory_limit(world: dict, encoder, out, limit: int = 6 << 30):
    """``rag-fast index build --encoder ENCODER --out OUT`` over the world's passages in a
    process whose address space is limited to ``limit`` bytes: (exit status, stderr)."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, "
            f"({limit}, {limit})); from rag_fast.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "index", "build", "--passages",
                           str(world["passages"]), "--encoder", str(encoder), "--out", str(out),
                           "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=Path(out).parent)
    return done.returncode, done.stderr


def one_error(code: int, err: str, *words: str) -> str:
    """The one ``rag-fast: error:`` line of a command that exited 2 (asserted), holding every
    one of ``words``."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rag-fast: error: "), err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def one_line(err: str) -> str:
    """The one line a command printed on stderr (asserted: one line, no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> dict[str, Path]:
    """{"encoder", "passages", "kb", "model", "config", "train", "dev", "root"}: built once."""
    root = tmp_path_factory.mktemp("safety-world")
    (root / "enc").mkdir()
    encoder = save_tiny_bert(root / "enc", WORDS)
    passages = root / "p.jsonl"
    with open(passages, "w", encoding="utf-8") as f:
        for i in range(24):
            city, river = ("paris", "seine") if i % 2 else ("rome", "tiber")
            f.write(json.dumps({"id": f"p{i}", "title": city,
                                "text": f"the city of {city} lies on the {river} river {i}"}) + "\n")
    qa = [{"question": "which river is paris on", "answers": ["seine"]},
          {"question": "which river is rome on", "answers": ["tiber"]}] * 4
    for name in ("train.jsonl", "dev.jsonl"):
        (root / name).write_text("".join(json.dumps(q) + "\n" for q in qa))
    (root / "g.json").write_text(json.dumps(GENERATOR))
    config = root / "train.json"
    config.write_text(json.dumps({
        "data": {"train": "train.jsonl", "eval": "dev.jsonl"},
        "train": {"max_steps": 2, "micro_batch_size": 2, "lr": 1e-3, "log_every": 1,
                  "checkpoint_every": 1, "eval_every": 0, "seed": 0, "device": "cpu",
                  "plot_file": None}}))
    code, err = run_cli("index", "build", "--passages", passages, "--encoder", encoder,
                        "--out", root / "kb", "--no-progress", "--max-length", "32")
    assert code == 0, err
    code, err = run_cli("init", "--index", root / "kb", "--generator", root / "g.json",
                        "--generator-tokenizer", TOKENIZER, "--n-docs", "2",
                        "--max-context-length", "48", "--out", root / "model")
    assert code == 0, err
    return {"root": root, "encoder": Path(encoder), "passages": passages, "kb": root / "kb",
            "model": root / "model", "config": config, "train": root / "train.jsonl",
            "dev": root / "dev.jsonl"}


@pytest.fixture
def copy_of(tmp_path):
    """``copy_of(path)``: a copy of a folder of the world in this test's tmp_path."""
    def copy(path: Path) -> Path:
        target = tmp_path / path.name
        shutil.copytree(path, target)
        return target
    return copy


# ---- a small disk ------------------------------------------------------------------------
DISK_KIB = 160


def _mount_tmpfs(path: Path, kib: int) -> bool:
    if os.environ.get("RAG_FAST_TEST_STAND_IN_DISK"):  # to test the stand-in where root mounts
        return False
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                          capture_output=True, check=False)
    return done.returncode == 0


def _under(fd: int, root: Path) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(root) + os.sep)
    except OSError:
        return False


class Disk:
    """A small disk at ``path``: a real tmpfs (``real``), or a folder whose allocations and
    (with ``can_allocate=False``) writes fail with ENOSPC once ``kib`` KiB are written."""

    def __init__(self, path: Path, kib: int, monkeypatch):
        self.path, self.kib, self.monkeypatch = path, kib, monkeypatch
        path.mkdir()
        self.real = _mount_tmpfs(path, kib)
        self.written = 0
        if not self.real:
            real_fallocate = os.posix_fallocate

            def fallocate(fd, offset, length):
                if _under(fd, path) and offset + length > kib * 1024:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_fallocate(fd, offset, length)

            monkeypatch.setattr(os, "posix_fallocate", fallocate)
            real_write_index = faiss.write_index

            def write_index(index, where, *args):  # faiss writes a saved index's files itself
                real_write_index(index, where, *args)
                if isinstance(where, str) and where.startswith(str(path) + os.sep):
                    size = os.path.getsize(where)
                    if size > kib * 1024:
                        os.truncate(where, kib * 1024)
                        raise RuntimeError(
                            "Error in void faiss::write_index(const Index*, IOWriter*, int) at "
                            "index_write.cpp:499: Error: 'ret == (size * 4)' failed: write error "
                            f"in {where}: {kib * 1024} != {size} (No space left on device)")

            monkeypatch.setattr(faiss, "write_index", write_index)
            real_write = os.write

            def write(fd, data):  # how an index's files are written (through faiss's callback)
                held = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
                if _under(fd, path) and held + len(data) > kib * 1024:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_write(fd, data)

            monkeypatch.setattr(os, "write", write)

    def cannot_allocate_ahead(self) -> None:
        """This disk's filesystem has no fallocate (and claims room to spare): a full disk
        shows first in a write."""
        def fallocate(fd, offset, length):
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

        self.monkeypatch.setattr(os, "posix_fallocate", fallocate)
        self.monkeypatch.setattr(storage.disk, "disk_free", lambda path: 1 << 40)
        if self.real:
            return
        real_pwrite = os.pwrite

        def pwrite(fd, data, offset):  # how the embeddings are written
            if _under(fd, self.path):
                self._fill(len(data))
            return real_pwrite(fd, data, offset)

        self.monkeypatch.setattr(os, "pwrite", pwrite)

    def _fill(self, nbytes: int) -> None:
        self.written += nbytes
        if self.written > self.kib * 1024:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def leftovers(self) -> list[str]:
        return sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*")
                      if ".tmp-" in p.name or ".new-" in p.name)

    def unmount(self) -> None:
        if self.real:
            subprocess.run(["umount", str(self.path)], check=True)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    d = Disk(tmp_path / "disk", DISK_KIB, monkeypatch)
    yield d
    d.unmount()


@pytest.fixture
def real_disk(disk):
    """A real small tmpfs: writers whose full-disk errors the stand-in cannot imitate
    (safetensors, torch.save, plain writes) need one. Only root may mount it; CI runs as root,
    so there its absence fails the test instead of skipping it."""
    if not disk.real:
        if IN_CI:
            pytest.fail("CI must be able to mount a small tmpfs (run as root)")
        pytest.skip("mounting a tmpfs needs root")
    return disk


@pytest.fixture(scope="session")
def fitted_tokenizer(world, tmp_path_factory):
    """A tokenizer folder `tokenizer fit` wrote."""
    out = tmp_path_factory.mktemp("tok") / "tok"
    code, err = run_cli("tokenizer", "fit", "--passages", world["passages"], "--vocab-size",
                        "300", "--out", out)
    assert code == 0, err
    return out


@pytest.fixture(scope="session")
def staged_shards(world, tmp_path_factory):
    """OUT.staging of two `--shard i/2` builds of the world's passages."""
    root = tmp_path_factory.mktemp("shards")
    for i in range(2):
        code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                            world["encoder"], "--out", root / "kb", "--no-progress", "--shard",
                            f"{i}/2")
        assert code == 0, err
    return root / "kb.staging"
