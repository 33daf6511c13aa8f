"""Breaks found by the second hostile pass over #41's fixes, one test each (they failed before
the fix): argparse usage errors in one line, --split 0, inputs that are not files, a merge
build whose settings differ from its shards', ..."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from conftest import TOKENIZER, one_error, one_line, run_cli



@pytest.mark.parametrize("argv,words", [
    (["train", "--config", "c.json", "--set", "train.lr"], "argument --set: expected KEY=VALUE"),
    (["train", "--config", "c.json", "--set", "=5"], "got '=5'"),
    (["generate", "--model", "m", "--question", "q", "--threads", "two"],
     "argument --threads: invalid int value: 'two'"),
    (["eval", "--data", "d.jsonl", "--num-beams", "1e3"],
     "argument --num-beams: invalid int value: '1e3'"),
    (["index", "build", "--passages", "p.jsonl", "--out", "kb"],
     "the following arguments are required: --encoder"),
    ([], "the following arguments are required"),
    (["index"], "the following arguments are required"),
])
def test_a_usage_error_is_one_line(capsys, argv, words):
    """argparse's own errors (a value of the wrong type, a malformed --set, a missing
    argument) are one line naming the command and its --help, as every other error is; they
    were argparse's usage block of 5-14 lines."""
    from rag_fast import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    command = " ".join(["rag-fast", *[a for a in argv[:2] if not a.startswith("-")]][:3])
    if argv[:1] != ["index"]:
        command = " ".join(["rag-fast", *argv[:1]])
    assert exit_.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith(f"{command}: error: ") and f"(see `{command} --help`)" in err, err
    assert words in err


@pytest.mark.parametrize("vocab_size", ["1000000000", "2147483648", str((1 << 20) + 1)])
def test_tokenizer_fit_refuses_a_vocabulary_too_large_to_set_aside(world, tmp_path, vocab_size):
    """`--vocab-size 10**9` made the tokenizers library ask for 70 GB before reading a text,
    then abort (exit 134 under `ulimit -v`): refused in one line, nothing written."""
    from test_long_lines import capped

    done = capped("tokenizer", "fit", "--passages", world["passages"], "--vocab-size",
                      vocab_size, "--out", tmp_path / "tok")
    line = one_error(done.returncode, done.stderr, "--vocab-size must be at most 1,048,576")
    assert f"{int(vocab_size):,}" in line
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize("kind", ["device", "folder", "fifo"])
@pytest.mark.parametrize("command", ["search", "build"])
def test_queries_that_are_not_a_file_are_named_as_what_they_are(world, tmp_path, kind, command):
    """`--queries /dev/zero`, a folder or a FIFO said "no such file"."""
    import os

    path, what = {"device": ("/dev/zero", "is a character device"),
                  "folder": (tmp_path / "questions", "is a folder"),
                  "fifo": (tmp_path / "questions.fifo", "is a named pipe")}[kind]
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    if command == "search":
        code, err = run_cli("index", "search", world["kb"], "--queries", path)
    else:
        code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                            world["encoder"], "--out", tmp_path / "kb", "--queries", path)
    one_error(code, err, f"--queries: {str(path)!r} {what}, not a regular file")
    assert not (tmp_path / "kb").exists() and not (tmp_path / "kb.staging").exists()


def test_a_merge_with_other_settings_than_its_shards_keeps_them_and_says_which(world, tmp_path):
    """Two `--shard i/2 --max-length 16` builds, then the merge without --max-length: it said
    "discarding stale staging" and deleted both shards; it refuses, naming the setting."""
    import hashlib

    build = ("index", "build", "--passages", world["passages"], "--encoder", world["encoder"],
             "--out", tmp_path / "kb", "--no-progress")
    for i in range(2):
        code, err = run_cli(*build, "--shard", f"{i}/2", "--max-length", "16")
        assert code == 0, err
    staging = tmp_path / "kb.staging"

    def contents() -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(staging.iterdir()) if p.is_file()}

    before = contents()
    assert {"embeddings-0-of-2.npy", "embeddings-1-of-2.npy", "shard-0-of-2.json"} <= set(before)
    for extra in ((), ("--remove-staging",), ("--max-length", "32"), ("--split", "5")):
        code, err = run_cli(*build, *extra)
        line = one_error(code, err, "holds shards staged by --shard builds with other settings")
        assert "discarding" not in err and contents() == before, extra
        if not extra or extra[0] == "--remove-staging":
            assert "--max-length 16 there, 256 here" in line
        assert not (tmp_path / "kb").exists()
    code, err = run_cli(*build, "--max-length", "16")  # the shards' settings: merged
    assert code == 0, err
    assert (tmp_path / "kb").is_dir() and contents() == before


@pytest.mark.parametrize("split", ["0", "-5"])
def test_split_must_be_a_number_of_words(world, tmp_path, split):
    """`--split 0` meant the default 100 words, silently (`--split -5` was refused without
    naming the flag)."""
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", tmp_path / "kb", "--split", split)
    one_error(code, err, f"--split must be a number of words >= 1, got {split}")
    assert not (tmp_path / "kb").exists() and not (tmp_path / "kb.staging").exists()


def _filled_to_every_level(root, args) -> Iterator[tuple[int, int, str]]:
    """Run ``rag-fast ARGS`` on the small disk ``root`` filled to leave 0, 4 KiB, 8 KiB ...
    free (everything else on it removed first), yielding ``(left, exit status, stderr)`` of
    each failed run; returns once a run succeeds, and fails the test if none does."""
    import os
    import shutil

    stats = os.statvfs(root)
    room = stats.f_bavail * stats.f_frsize
    for left in range(0, room, 4096):
        for entry in root.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        (root / "filler").write_bytes(b"\0" * (room - left))
        code, err = run_cli(*args)
        if code == 0:
            return
        yield left, code, err
    pytest.fail(f"rag-fast {args[0]} never fit in {room} bytes")


@pytest.mark.parametrize("shard", [None, "0/2"])
def test_index_build_on_a_disk_filled_to_any_level_fails_in_one_line_naming_a_file(
        world, real_disk, shard, capfd):
    """A 300-passage build onto a nearly full tmpfs printed the repr of copytree's list of
    failed copies; a `--shard 0/2` build printed "No space left on device" and no file. Swept
    over the room left, 4 KiB at a time, until the build fits: every failure is the one line
    naming a file under the disk, and leaves nothing but a --shard build's staging."""
    import os

    root = real_disk.path
    args = ["index", "build", "--passages", world["passages"], "--encoder", world["encoder"],
            "--out", root / "kb", "--no-progress"] + (["--shard", shard] if shard else [])
    failures = 0
    for left, code, err in _filled_to_every_level(root, args):
        # nothing else on the process's stderr (faiss printed "close error" lines of its own)
        assert capfd.readouterr().err == "", left
        failures += 1
        one_error(code, err, f"no space left on device writing {root}{os.sep}kb")
        assert "Errno" not in err and "[(" not in err, err
        assert {p.name for p in root.iterdir()} <= {"filler", "kb.staging"} if shard else \
            {p.name for p in root.iterdir()} == {"filler"}, left
    assert capfd.readouterr().err == ""  # the run that fit, likewise
    assert failures >= 3  # the sweep met the full disk at several stages


def test_a_run_on_a_busy_machine_that_fails_says_so_in_one_line(world, tmp_path, monkeypatch,
                                                                 capsys):
    """On a machine other processes kept busy, the wait-policy notice went to stderr before a
    train error: two lines. The notice is the run's log (stdout); the error is the one line."""
    from rag_fast import _threads
    from rag_fast.training import trainer

    def fail(*args, **kwargs):
        raise OSError("a failure of the run (a stand-in)")

    monkeypatch.setattr(_threads, "COMMAND_POLICY", "PASSIVE")
    monkeypatch.setattr(trainer.Trainer, "_train_loop", fail)
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", tmp_path / "run", "--set", "train.progress=false")
    one_error(code, err, "a failure of the run")
    assert "OMP_WAIT_POLICY=PASSIVE" in capsys.readouterr().out


def test_more_ctrl_c_add_no_line(world, tmp_path):
    """Two Ctrl-C during an index build printed "interrupted; nothing was written ..." and then
    "interrupted while reporting the command's end" (or "... while exiting"). Once the command
    said its line, more Ctrl-C (here one every 20 ms until it ends) end it without another."""
    import json
    import signal
    import time

    from conftest import start_command

    passages = tmp_path / "p.jsonl"
    passages.write_text("".join(json.dumps({"id": f"p{i}", "title": "paris",
                                            "text": "the city of paris lies on the seine " * 8})
                                + "\n" for i in range(20000)))
    proc = start_command("index", "build", "--passages", passages, "--encoder", world["encoder"],
                         "--out", tmp_path / "kb", "--threads", "1", "--no-progress")
    deadline = time.monotonic() + 120
    while not (tmp_path / "kb.staging").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    # 130, or killed by a SIGINT in the last moments of the interpreter's exit (where Python
    # has put the default handler back): a shell says 130 for both
    assert proc.returncode in (130, -signal.SIGINT), err
    assert one_line(err).startswith("rag-fast: interrupted"), err
    assert not (tmp_path / "kb").exists()


@pytest.mark.parametrize("name", ["checkpoint-last.pt", "checkpoint-last.json"])
def test_a_checkpoint_link_planted_in_the_run_leading_out_is_refused(world, tmp_path, name):
    """A checkpoint-last.pt moved out of the run and replaced by a link to it was read on
    resume and the link then replaced; a link planted where the run resumes from is refused
    before any step, and the file it leads to is neither read for the resume nor changed."""
    import hashlib

    from test_run_files import _train

    out = tmp_path / "r"
    assert _train(world, out)[0] == 0
    outside = tmp_path / name
    (out / name).rename(outside)
    (out / name).symlink_to(outside)
    before = hashlib.sha256(outside.read_bytes()).hexdigest()
    code, err = _train(world, out, "--max-steps", "3")
    one_error(code, err, name, "leads out of it")
    assert (out / name).is_symlink() and hashlib.sha256(outside.read_bytes()).hexdigest() == before


@pytest.mark.parametrize("command", ["eval", "index eval"])
def test_an_evaluation_onto_a_full_disk_leaves_no_folder(world, real_disk, command):
    """`eval --out` and `index eval --out` on a full disk said so in one line but left the
    (empty, or marked) folder they had made. Swept over the room left, 4 KiB at a time, until
    the evaluation fits. The data's warning (the dev file has no gold passage ids) is said
    only once the outputs are written (the fourth pass: two lines)."""
    root = real_disk.path
    out = root / "e"
    if command == "eval":
        args = ["eval", "--data", world["dev"], "--model", world["model"], "--out", out,
                "--num-beams", "1", "--max-new-tokens", "2", "--no-progress"]
    else:
        args = ["index", "eval", "--data", world["dev"], "--index", world["kb"], "--out", out]
    failures = 0
    for left, code, err in _filled_to_every_level(root, args):
        failures += 1
        one_error(code, err, "no space left on device writing")
        assert [p.name for p in root.iterdir()] == ["filler"], (left, err)
    assert failures >= 2 and (out / "metrics.json").is_file()


# ---- the third pass ------------------------------------------------------------------------
@pytest.mark.parametrize("plant", ["dev-zero", "sparse-20g", "folder", "fifo"])
def test_an_index_manifest_that_is_no_small_file_is_refused_unread(world, copy_of, plant):
    """An index's manifest.json replaced by a link to /dev/zero was read whole: all the
    machine's memory, then the kernel's kill (or, capped, "out of memory" naming no file)."""
    import os

    kb = copy_of(world["kb"])
    manifest = kb / "manifest.json"
    manifest.unlink()
    if plant == "dev-zero":
        manifest.symlink_to("/dev/zero")
    elif plant == "sparse-20g":
        with open(manifest, "wb") as f:
            f.truncate(20 << 30)
    elif plant == "folder":
        manifest.mkdir()
    else:
        os.mkfifo(manifest)
    code, err = run_cli("index", "search", kb, "which river is paris on")
    line = one_error(code, err, str(manifest))
    if plant == "dev-zero":  # refused as a link, whatever it leads to (eighth pass, T47d)
        assert "is a symbolic link (to '/dev/zero')" in line, line
    else:
        assert ("not a regular file" in line) != (plant == "sparse-20g"), line


@pytest.mark.parametrize("plant", ["dangling", "folder", "dev-zero"])
def test_a_model_s_side_file_that_is_no_file_is_refused_not_skipped(world, copy_of, plant):
    """A rag_fast.json replaced by a dangling link, a folder or a link to /dev/zero counted as
    absent: the model loaded unchecked (a corrupted model.safetensors was used)."""
    model = copy_of(world["model"])
    side = model / "rag_fast.json"
    side.unlink()
    if plant == "dangling":
        side.symlink_to("nowhere")
    elif plant == "folder":
        side.mkdir()
    else:
        side.symlink_to("/dev/zero")
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, err = run_cli("generate", "--model", model, "--question", "x", "--num-beams", "1",
                        "--max-new-tokens", "1", "--no-progress")
    one_error(code, err, str(side))


@pytest.mark.parametrize("key,value,words", [
    ("metrics_file", "d/" * 3000 + "m.jsonl", "3001 folders deep"),   # a RecursionError, exit 1
    ("metrics_file", "m" * 300, "300 bytes, more than the 223"),      # failed after a step
    ("metrics_file", "m.jsonl/", "must name a file, not a folder"),   # failed after a step
    ("plot_file", "p" * 300 + ".png", "304 bytes, more than the 223"),  # trained, plot lost
])
def test_run_file_names_the_filesystem_cannot_hold_are_refused_before_the_run(
        world, tmp_path, key, value, words):
    """Refused in one line naming the key, before the run folder is made."""
    from test_run_files import _train

    out = tmp_path / "r"
    code, err = _train(world, out, "--set", f"train.{key}={value}")
    line = one_error(code, err, f"--set train.{key}=", words)
    assert len(line) < 400 and not out.exists(), line


@pytest.mark.parametrize("marker", ["kept", "removed"])
@pytest.mark.parametrize("edit", ["empty-object", "bad-json", "bad-model-type"])
def test_init_refuses_a_hand_edited_tokenizer_in_one_line(world, fitted_tokenizer, tmp_path,
                                                          marker, edit):
    """A tokenizer.json edited by hand ('{}', a model type transformers does not know) made
    init fail with an unexpected KeyError (exit 1); invalid JSON said "Expecting value"
    naming neither the file nor the flag. With the marker `tokenizer fit` wrote, the edit is
    found by its SHA-256; without it, the library's failure is one line naming the flag."""
    import json
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(fitted_tokenizer, tok)
    if marker == "removed":
        (tok / "rag_fast-output.json").unlink()
    path = tok / "tokenizer.json"
    if edit == "empty-object":
        path.write_text("{}")
    elif edit == "bad-json":
        path.write_text("{\n")
    else:
        data = json.loads(path.read_text())
        data["model"]["type"] = "Nope"
        path.write_text(json.dumps(data))
    code, err = run_cli("init", "--index", world["kb"], "--generator", world["root"] / "g.json",
                        "--generator-tokenizer", tok, "--out", tmp_path / "m")
    line = one_error(code, err, f"--generator-tokenizer {str(tok)!r}")
    if marker == "kept":
        assert "tokenizer.json is missing or differs from what `rag-fast tokenizer fit` wrote" \
            in line, line
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("command", ["generate", "eval"])
@pytest.mark.parametrize("kind", ["device", "file", "fifo"])
def test_a_model_that_is_no_folder_is_named_as_what_it_is(world, tmp_path, command, kind):
    """`generate --model /dev/zero` (a device, a FIFO, a file) said "no such directory"."""
    import os

    path, what = {"device": ("/dev/zero", "is not a folder (a device or a pipe?)"),
                  "file": (world["dev"], "is a file, not a folder"),
                  "fifo": (tmp_path / "m.fifo", "is not a folder (a device or a pipe?)")}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    if command == "generate":
        code, err = run_cli("generate", "--model", path, "--question", "x")
    else:
        code, err = run_cli("eval", "--model", path, "--data", world["dev"], "--out",
                            tmp_path / "e")
    one_error(code, err, str(path), what)


@pytest.mark.parametrize("part", ["", "passages", "index"])
@pytest.mark.parametrize("value", [99, "1", True])
def test_an_index_manifest_of_another_format_is_refused_even_resealed(world, copy_of, part,
                                                                       value):
    """An index's manifest.json edited to "format": 99 and resealed was searched as if it
    were format 1 (a model's rag_fast.json of format 99 was refused)."""
    import json

    kb = copy_of(world["kb"])
    manifest = kb / part / "manifest.json"
    data = json.loads(manifest.read_text())
    data["format"] = value
    manifest.write_text(json.dumps(data))
    code, err = run_cli("reseal", kb / part if part else kb)
    assert code == 0, err
    code, err = run_cli("index", "search", kb, "which river is paris on")
    one_error(code, err, "format", str(manifest))


# ---- the fourth pass ----------------------------------------------------------------------
@pytest.mark.parametrize("tamper", ["flipped-byte", "truncated", "fifo", "dev-zero",
                                    "record-edited", "record-folder"])
def test_a_merge_checks_every_staged_shard_against_its_record(world, staged_shards, tmp_path,
                                                              tamper):
    """The third pass: a merge read no record: a flipped byte or shard 1's file in shard 0's
    place was built and sealed into the index, a FIFO hung it, a truncated file or a link to
    /dev/zero gave a line naming no file, an edited or missing record was ignored."""
    import os
    import shutil

    staging = tmp_path / "kb.staging"
    shutil.copytree(staged_shards, staging)
    shard, record = staging / "embeddings-0-of-2.npy", staging / "shard-0-of-2.json"
    if tamper == "flipped-byte":
        data = bytearray(shard.read_bytes())
        data[300] ^= 0x01
        shard.write_bytes(bytes(data))
    elif tamper == "truncated":
        os.truncate(shard, 200)
    elif tamper in ("fifo", "dev-zero"):
        shard.unlink()
        os.mkfifo(shard) if tamper == "fifo" else shard.symlink_to("/dev/zero")
    elif tamper == "record-edited":
        record.write_text(record.read_text().replace('"bytes": ', '"bytes": 1'))
    else:
        record.unlink()
        record.mkdir()
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", tmp_path / "kb", "--no-progress")
    one_error(code, err, str(shard), "is not the file its record shard-0-of-2.json lists")
    assert not (tmp_path / "kb").exists()


def test_a_tokenizer_folder_with_a_file_its_marker_does_not_list_is_refused(
        world, fitted_tokenizer, tmp_path):
    """An added_tokens.json put in a `tokenizer fit` folder was read by transformers: the
    initialised model's tokenizer carried the injected token."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(fitted_tokenizer, tok)
    (tok / "added_tokens.json").write_text('{"SECRETTOKEN": 500}')
    code, err = run_cli("init", "--index", world["kb"], "--generator", world["root"] / "g.json",
                        "--generator-tokenizer", tok, "--out", tmp_path / "m")
    one_error(code, err, "'added_tokens.json'", "did not write")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("plant", ["sparse-20g", "dev-zero"])
def test_a_checkpoint_manifest_that_is_no_small_file_is_refused_unread(world, tmp_path, plant):
    """checkpoint-last.json as a 20 GB sparse file was read whole: killed, or "out of memory"
    naming no file."""
    from test_run_files import _train

    out = tmp_path / "r"
    assert _train(world, out)[0] == 0
    manifest = out / "checkpoint-last.json"
    manifest.unlink()
    if plant == "dev-zero":
        manifest.symlink_to("/dev/zero")
    else:
        with open(manifest, "wb") as f:
            f.truncate(20 << 30)
    code, err = _train(world, out, "--max-steps", "3")
    one_error(code, err, "checkpoint-last.json")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_eval_predictions_that_are_no_file_are_refused_unopened(world, tmp_path, kind):
    """`eval --predictions FIFO` hung; /dev/zero was read for 64 MiB."""
    import os

    path = tmp_path / "p.fifo" if kind == "fifo" else "/dev/zero"
    if kind == "fifo":
        os.mkfifo(path)
    code, err = run_cli("eval", "--predictions", path, "--data", world["dev"])
    one_error(code, err, "--predictions", "not a regular file")


def test_a_generator_config_nested_too_deeply_is_one_line(world, tmp_path):
    """`init --generator` a JSON file of 100,000 nested lists: an unexpected RecursionError."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    code, err = run_cli("init", "--index", world["kb"], "--generator", deep,
                        "--generator-tokenizer", TOKENIZER, "--out", tmp_path / "m")
    one_error(code, err, str(deep), "nested too deeply")


@pytest.mark.parametrize("held", ["metrics-notes", "both-notes", "metrics-link", "earlier-eval"])
def test_eval_out_takes_a_markerless_folder_only_when_it_is_an_earlier_eval(world, tmp_path,
                                                                           held):
    """A folder holding a user's metrics.json ("my notes") and/or predictions.jsonl, or a link
    named metrics.json, was taken for an earlier rag_fast's evaluation folder by the names
    alone, and overwritten. An earlier evaluation (its two files, no marker) still is."""
    import shutil

    out = tmp_path / "e"
    args = ["eval", "--data", world["dev"], "--model", world["model"], "--out", out,
            "--num-beams", "1", "--max-new-tokens", "2", "--no-progress"]
    if held == "earlier-eval":
        code, err = run_cli(*args)
        assert code == 0, err
        (out / "rag_fast-output.json").unlink()  # as an earlier rag_fast left it
    else:
        out.mkdir()
        (out / "metrics.json").write_text("my notes\n")
        if held == "both-notes":
            (out / "predictions.jsonl").write_text("{}\n")
        elif held == "metrics-link":
            (out / "metrics.json").unlink()
            (tmp_path / "target.txt").write_text("mine\n")
            (out / "metrics.json").symlink_to(tmp_path / "target.txt")
    before = {p.name: (p.is_symlink(), p.read_bytes()) for p in out.iterdir()}
    code, err = run_cli(*args)
    if held == "earlier-eval":
        assert code == 0, err
        return
    one_error(code, err, "--out", "did not write")
    assert {p.name: (p.is_symlink(), p.read_bytes()) for p in out.iterdir()} == before
    shutil.rmtree(out)


def test_init_names_the_flag_for_an_empty_tokenizer_folder_and_a_huge_seed(world, tmp_path):
    """`--generator-tokenizer EMPTY_DIR` said transformers' "Couldn't instantiate the backend
    tokenizer" naming nothing; `--seed 10**23` said "Overflow when unpacking long long"."""
    (tmp_path / "empty").mkdir()
    base = ["init", "--index", world["kb"], "--generator", world["root"] / "g.json", "--out",
            tmp_path / "m"]
    code, err = run_cli(*base, "--generator-tokenizer", tmp_path / "empty")
    one_error(code, err, f"--generator-tokenizer {str(tmp_path / 'empty')!r}")
    code, err = run_cli(*base, "--generator-tokenizer", TOKENIZER, "--seed", str(10**23))
    one_error(code, err, "--seed must be in [0, 2**63)")
    assert not (tmp_path / "m").exists()


def test_a_resume_keeps_bytes_of_the_metrics_file_that_are_not_utf8(world, tmp_path):
    """Random bytes appended to a run's metrics.jsonl made the resume fail with "'utf-8' codec
    can't decode" naming no file; lines that are not the trainer's are kept as they are."""
    from test_run_files import _train

    out = tmp_path / "r"
    assert _train(world, out)[0] == 0
    junk = b"\n\xf0\x28\x8c\x28 not ours\n"
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(junk)
    code, err = _train(world, out, "--max-steps", "3")
    assert code == 0, err
    assert junk.strip() in (out / "metrics.jsonl").read_bytes()
