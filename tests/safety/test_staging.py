"""`rag-fast index build` removes only what its builds staged in ``OUT.staging/``.

Every shard a build encodes is recorded beside it (``shard-i-of-n.json``: the file's size and
SHA-256), and the staging folder is removed entry by entry, only what a build staged there:
``key.json``, ``passages/`` holding only what its manifests list, each embeddings file that
matches its record, and the temporary folders of builds that are gone. ``--remove-staging``
refuses a staging folder holding anything else (a note, a subfolder, a symbolic link, a file
named like a temporary) before the merge, naming it; a failed build removes the staging folder
it created and never one ``--shard`` builds made; ``--out`` must name a folder of its own.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import run_cli
from rag_fast.retrieval import DenseIndex, encoders
from rag_fast.storage import NoSpaceError


def _build(world, out, *extra):
    return run_cli("index", "build", "--passages", world["passages"], "--encoder",
                   world["encoder"], "--out", out, "--no-progress", "--max-length", "32",
                   "--preset", "exact", "--device", "cpu", *extra)


def _one_error(code, err, *words):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rag-fast: error: "), err
    assert "PosixPath" not in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _listing(folder):
    """Every path under ``folder`` (links not followed), relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _stage_two_shards(world, out):
    for i in range(2):
        code, err = _build(world, out, "--shard", f"{i}/2")
        assert code == 0, err
    return out.with_name(out.name + ".staging")


def _never_merge(monkeypatch):
    """A merge that is reached fails the test: the refusal must come before it."""
    def merge(*args, **kwargs):
        raise AssertionError("the merge ran before the staging folder was checked")

    monkeypatch.setattr(DenseIndex, "build", merge)


# ---- --remove-staging removes only what the builds staged ----------------------------------
def test_remove_staging_refuses_a_note_before_the_merge(world, tmp_path, monkeypatch):
    staging = _stage_two_shards(world, tmp_path / "kb")
    (staging / "note.txt").write_text("mine")
    before = _listing(staging)
    _never_merge(monkeypatch)
    line = _one_error(*_build(world, tmp_path / "kb", "--remove-staging"), "--remove-staging",
                      str(staging), "'note.txt'", "did not write")
    assert "more" not in line
    assert (staging / "note.txt").read_text() == "mine" and _listing(staging) == before
    assert not (tmp_path / "kb").exists()


def test_remove_staging_names_the_first_foreign_entry_and_a_count(world, tmp_path,
                                                                   monkeypatch):
    staging = _stage_two_shards(world, tmp_path / "kb")
    mine = tmp_path / "mine.txt"
    mine.write_text("mine")
    (staging / "a-folder").mkdir()
    (staging / "a-folder" / "data.txt").write_text("data")
    (staging / "link").symlink_to(mine)
    (staging / "passages" / "notes.md").write_text("notes")
    before = _listing(staging)
    _never_merge(monkeypatch)
    _one_error(*_build(world, tmp_path / "kb", "--remove-staging"), "'a-folder' and 2 more")
    assert _listing(staging) == before and mine.read_text() == "mine"


def test_remove_staging_removes_what_the_shards_wrote(world, tmp_path):
    staging = _stage_two_shards(world, tmp_path / "kb")
    assert sorted(p.name for p in staging.iterdir()) == [
        "embeddings-0-of-2.npy", "embeddings-1-of-2.npy", "key.json", "passages",
        "shard-0-of-2.json", "shard-1-of-2.json"]
    record = json.loads((staging / "shard-1-of-2.json").read_text())
    assert record["kind"] == "rag_fast.staged_shard" and set(record["files"]) == {
        "embeddings-1-of-2.npy"}
    assert record["files"]["embeddings-1-of-2.npy"]["bytes"] == os.path.getsize(
        staging / "embeddings-1-of-2.npy")
    code, err = _build(world, tmp_path / "kb", "--remove-staging")
    assert code == 0, err
    assert not staging.exists() and (tmp_path / "kb" / "manifest.json").is_file()


@pytest.mark.parametrize("attack", ["replaced", "unrecorded", "record-edited"])
def test_a_shard_file_its_record_does_not_vouch_for_is_kept(world, tmp_path, monkeypatch,
                                                            attack):
    """A user's file in a shard's place: the same name and size, other bytes; a shard file no
    build recorded; a record edited to match another file."""
    staging = _stage_two_shards(world, tmp_path / "kb")
    shard = staging / "embeddings-1-of-2.npy"
    if attack == "replaced":
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        named = "embeddings-1-of-2.npy"
    elif attack == "unrecorded":
        np.save(staging / "embeddings-0-of-3.npy", np.zeros((8, 16), np.float16))
        named = "embeddings-0-of-3.npy"
    else:
        record = staging / "shard-0-of-2.json"
        payload = json.loads(record.read_text())
        payload["files"]["embeddings-0-of-2.npy"]["bytes"] += 1
        record.write_text(json.dumps(payload))
        named = "embeddings-0-of-2.npy"
    before = {p: p.read_bytes() for p in staging.iterdir() if p.is_file()}
    _never_merge(monkeypatch)
    _one_error(*_build(world, tmp_path / "kb", "--remove-staging"), f"'{named}'")
    assert {p: p.read_bytes() for p in staging.iterdir() if p.is_file()} == before


def test_links_named_like_staged_entries_are_never_taken_for_them(world, tmp_path, monkeypatch):
    """``passages`` and a shard file replaced by symbolic links to the user's data."""
    staging = _stage_two_shards(world, tmp_path / "kb")
    kb = tmp_path / "theirs"
    shutil.copytree(world["kb"], kb)
    theirs = _listing(kb)
    os.rename(staging / "passages", tmp_path / "moved")
    (staging / "passages").symlink_to(kb / "passages")
    shard = staging / "embeddings-0-of-2.npy"
    os.rename(shard, tmp_path / "shard.npy")
    shard.symlink_to(tmp_path / "shard.npy")
    _never_merge(monkeypatch)
    _one_error(*_build(world, tmp_path / "kb", "--remove-staging"), "'embeddings-0-of-2.npy'",
               "and 1 more")
    assert _listing(kb) == theirs and (tmp_path / "shard.npy").is_file()
    assert (staging / "passages").is_symlink() and shard.is_symlink()


def test_files_named_like_temporaries_are_kept(world, tmp_path, monkeypatch):
    """Names of rag_fast's temporaries, of earlier versions and of this one, given to files
    (a build's temporaries are folders) and to a folder holding a file of the user's."""
    staging = _stage_two_shards(world, tmp_path / "kb")
    names = [".embeddings-0-of-2.npy.tmp-99999999", ".key.json.tmp-abcdefgh",
             ".passages.tmp-99999999-0badf00d", ".shard-0-of-2.json.tmp-99999999-0badf00d"]
    for name in names[:3]:
        (staging / name).write_text("mine")
    (staging / names[3]).mkdir()
    (staging / names[3] / "mine.txt").write_text("mine")
    before = _listing(staging)
    _never_merge(monkeypatch)
    _one_error(*_build(world, tmp_path / "kb", "--remove-staging"), f"'{names[0]}' and 3 more")
    assert _listing(staging) == before


def test_a_staging_another_build_is_writing_is_refused(world, tmp_path, monkeypatch):
    """A temporary folder of a process still alive (this one) is no leftover: refused."""
    staging = _stage_two_shards(world, tmp_path / "kb")
    busy = staging / f".embeddings-1-of-2.npy.tmp-{os.getpid()}-0badf00d"
    busy.mkdir()
    _never_merge(monkeypatch)
    _one_error(*_build(world, tmp_path / "kb", "--remove-staging"), f"'{busy.name}'",
               f"process {os.getpid()}", "still writing")
    assert busy.is_dir()


def test_a_staging_folder_that_is_a_link_is_refused(world, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "kb.staging").symlink_to(elsewhere)
    for extra in (["--shard", "0/2"], []):
        _one_error(*_build(world, tmp_path / "kb", *extra), "kb.staging", "symbolic link")
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "kb").exists()


def test_a_build_without_shards_keeps_a_note_in_its_staging(world, tmp_path, monkeypatch):
    """The single build removes its staging folder when done: a note there is refused before
    any work, not deleted with it."""
    code, err = _build(world, tmp_path / "kb", "--shard", "0/1")
    assert code == 0, err
    staging = tmp_path / "kb.staging"
    (staging / "note.txt").write_text("mine")
    before = _listing(staging)
    _never_merge(monkeypatch)
    _one_error(*_build(world, tmp_path / "kb"), str(staging), "'note.txt'", "did not write")
    assert _listing(staging) == before


# ---- a failed build removes the staging folder it created, and no other --------------------
def _fail(monkeypatch, target, name, exc):
    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(target, name, fail)


@pytest.mark.parametrize("how", ["exception", "interrupt", "full-disk", "bad-line"])
def test_a_failed_build_leaves_no_staging_folder(world, tmp_path, monkeypatch, how):
    passages = world["passages"]
    if how == "exception":
        _fail(monkeypatch, DenseIndex, "build", ValueError("simulated failure in the merge"))
    elif how == "interrupt":
        _fail(monkeypatch, encoders.Encoder, "embed", KeyboardInterrupt())
    elif how == "full-disk":
        _fail(monkeypatch, encoders, "reserve_space", NoSpaceError(tmp_path / "x", 1 << 20, 0))
    else:
        lines = world["passages"].read_text().splitlines()
        lines[12] = '{"id": "p12", "text": '  # a record cut short, half-way through the file
        passages = tmp_path / "p.jsonl"
        passages.write_text("\n".join(lines) + "\n")
    code, err = run_cli("index", "build", "--passages", passages, "--encoder", world["encoder"],
                        "--out", tmp_path / "kb", "--no-progress", "--max-length", "32",
                        "--device", "cpu")
    assert code == (130 if how == "interrupt" else 2), err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["p.jsonl"] if how == "bad-line" else [])


def test_a_ctrl_c_after_the_swap_says_the_index_is_whole(world, tmp_path, monkeypatch):
    """The nineteenth hostile pass (K502): a Ctrl-C once the new index was in place (while its
    staging folder was being removed) said "nothing was written"."""
    from rag_fast.retrieval import bundle

    real = bundle._discard_staging
    _fail(monkeypatch, bundle, "_discard_staging", KeyboardInterrupt())
    code, err = _build(world, tmp_path / "kb")
    assert code == 130, err
    [line] = err.strip().splitlines()
    assert line.startswith("rag-fast: interrupted; the index was written whole to "), line
    assert "nothing was written" not in line and "kb.staging" in line, line
    assert (tmp_path / "kb" / "manifest.json").is_file() and (tmp_path / "kb.staging").is_dir()
    monkeypatch.setattr(bundle, "_discard_staging", real)  # the next build removes what it left
    code, err = _build(world, tmp_path / "kb", "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kb"]


def test_a_failed_merge_keeps_the_staged_shards(world, tmp_path, monkeypatch):
    staging = _stage_two_shards(world, tmp_path / "kb")
    before = {p.name: p.read_bytes() for p in staging.iterdir() if p.is_file()}
    _fail(monkeypatch, DenseIndex, "build", KeyboardInterrupt())
    assert _build(world, tmp_path / "kb", "--remove-staging")[0] == 130
    assert {p.name: p.read_bytes() for p in staging.iterdir() if p.is_file()} == before
    assert (staging / "passages" / "manifest.json").is_file()


def test_a_failed_shard_build_keeps_the_staging(world, tmp_path, monkeypatch):
    assert _build(world, tmp_path / "kb", "--shard", "0/2")[0] == 0
    _fail(monkeypatch, encoders.Encoder, "embed", ValueError("simulated failure"))
    assert _build(world, tmp_path / "kb", "--shard", "1/2")[0] == 2
    assert sorted(p.name for p in (tmp_path / "kb.staging").iterdir()) == [
        "embeddings-0-of-2.npy", "key.json", "passages", "shard-0-of-2.json"]


# ---- a kill ----------------------------------------------------------------------------------
_SLOW_BUILD = """
import sys, time
from rag_fast import cli
from rag_fast.retrieval import encoders
encoders.Encoder.embed = lambda self, **kw: time.sleep(600)
sys.exit(cli.main(sys.argv[1:]))
"""


def _killed_while_encoding(world, out, *extra):
    """Start a build whose encoding never ends, SIGKILL it once it writes its embeddings."""
    staging = out.with_name(out.name + ".staging")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_BUILD, "index", "build", "--passages", str(world["passages"]),
         "--encoder", str(world["encoder"]), "--out", str(out), "--no-progress", "--max-length",
         "32", "--device", "cpu", *extra], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (staging.is_dir() and any(p.name.startswith(".embeddings-") for p in staging.iterdir())):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the build never started encoding"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    return staging


def test_a_killed_shard_build_leaves_only_what_the_merge_removes(world, tmp_path):
    staging = _killed_while_encoding(world, tmp_path / "kb", "--shard", "0/2")
    left = sorted(p.name for p in staging.iterdir())
    assert left[0].startswith(".embeddings-0-of-2.npy.tmp-") and left[1:] == ["key.json", "passages"]
    for i in range(2):
        assert _build(world, tmp_path / "kb", "--shard", f"{i}/2")[0] == 0
    (staging / "note.txt").write_text("mine")
    _one_error(*_build(world, tmp_path / "kb", "--remove-staging"), "'note.txt'")
    (staging / "note.txt").unlink()
    code, err = _build(world, tmp_path / "kb", "--remove-staging")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kb"]


def test_a_killed_build_is_finished_and_cleaned_by_the_next(world, tmp_path):
    _killed_while_encoding(world, tmp_path / "kb")
    code, err = _build(world, tmp_path / "kb")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kb"]


# ---- --out names a folder of its own; paths as typed ------------------------------------------
@pytest.mark.parametrize("value, why", [
    (".", "it is the current folder"), ("..", "it is the parent folder"),
    ("/", "it is the root folder"), ("", "it is empty"), ("foo/..", "it is the current folder"),
    ("foo/bar/..", "it ends in '..'")])
def test_out_must_name_a_folder_of_its_own(world, tmp_path, monkeypatch, value, why):
    monkeypatch.chdir(tmp_path)
    line = _one_error(*_build(world, value), f"--out {value!r} names no folder of its own ({why})")
    assert line.endswith("give a new folder's path such as work/kb")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, flag", [
    (["index", "search", "", "paris"], "DIR ''"),
    (["index", "search", "{kb}", "--queries", ""], "--queries ''"),
    (["index", "search", "{kb}", "paris", "--out", ""], "--out ''"),
    (["index", "eval", "--data", "{dev}", "--index", ""], "--index ''"),
    (["index", "eval", "--data", "", "--index", "{kb}"], "--data ''"),
    (["index", "eval", "--data", "{dev}", "--index", "{kb}", "--out", ""], "--out ''"),
    (["index", "build", "--passages", "", "--encoder", "{encoder}", "--out", "kb", "--no-progress"],
     "--passages ''"),
])
def test_an_empty_path_is_named_as_typed(world, tmp_path, monkeypatch, argv, flag):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(kb=world["kb"], dev=world["dev"], encoder=world["encoder"]) for a in argv]
    line = _one_error(*run_cli(*argv), flag, "is empty")
    assert "'.'" not in line
    assert list(tmp_path.iterdir()) == []


# ---- concurrent builds, and what sharded training adds ------------------------------------------
def _claim_with_others(staging, start, errors):
    from rag_fast.retrieval import bundle

    start.wait()
    try:
        bundle._claim_staging(staging, {"passages_sha256": "x"}, sharded=True, log=print)
    except ValueError as e:
        errors.append(str(e))


def test_shard_builds_started_together_share_one_staging(tmp_path):
    """Claims started at once (threads here: the same code path as processes) all agree on
    the one key published first; none is refused while it is being published."""
    import threading

    for round_ in range(10):
        staging, start, errors = tmp_path / f"r{round_}.staging", threading.Barrier(6), []
        threads = [threading.Thread(target=_claim_with_others, args=(staging, start, errors))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and sorted(p.name for p in staging.iterdir()) == ["key.json"]


def test_what_sharded_training_caches_there_is_removed_with_it(world, tmp_path):
    """Token caches in passages/ and cached shard indexes (index-i-of-n-TAG/) are rag_fast's."""
    from transformers import AutoTokenizer

    from rag_fast.retrieval import PassageStore

    staging = _stage_two_shards(world, tmp_path / "kb")
    PassageStore.load(staging / "passages").tokenized(
        AutoTokenizer.from_pretrained(str(world["encoder"])), progress=False)
    vectors = np.load(staging / "embeddings-0-of-2.npy").astype(np.float32)
    DenseIndex.build(vectors, "exact", progress=False).save(staging / "index-0-of-2-0123456789ab")
    assert (staging / "passages" / "tokens").is_dir()
    code, err = _build(world, tmp_path / "kb", "--remove-staging")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kb"]


_KILLED_WHILE_REMOVING = """
import os, shutil, signal, sys
from rag_fast import cli
real = shutil.rmtree
def rmtree(path, *args, **kwargs):
    if os.path.basename(path).startswith(".passages.tmp-"):  # passages/, moved aside to go
        real(os.path.join(path, "passages", "manifest.json"), ignore_errors=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *args, **kwargs)
shutil.rmtree = rmtree
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_kill_while_the_staging_is_removed_is_cleaned_by_the_next_build(world, tmp_path):
    staging = _stage_two_shards(world, tmp_path / "kb")
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_REMOVING, "index", "build", "--passages",
         str(world["passages"]), "--encoder", str(world["encoder"]), "--out",
         str(tmp_path / "kb"), "--no-progress", "--max-length", "32", "--preset", "exact",
         "--device", "cpu", "--remove-staging"], capture_output=True, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    left = sorted(p.name for p in staging.iterdir())
    assert left[0].startswith(".passages.tmp-") and "passages" not in left, left
    code, err = _build(world, tmp_path / "kb", "--remove-staging", "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kb"]
