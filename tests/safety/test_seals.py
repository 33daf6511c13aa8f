"""Every file that decides behaviour is verified: a model's ``rag_fast.json`` and an index
directory's manifests carry a seal (the SHA-256 of their canonical JSON), so a hand edit is an
error naming the file and ``rag-fast reseal DIR``, the documented way to accept an edit made
on purpose. Every path a manifest lists is relative, normalised and inside its folder."""
from __future__ import annotations

import json
import os

import pytest

from conftest import run_cli
from rag_fast.models import RagModel
from rag_fast.models.checkpoint import ModelDirError
from rag_fast.retrieval import StorageError


def _edit(path, change):
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload, indent=1))


@pytest.mark.parametrize("change", [
    lambda s: s["options"].update(n_docs=1),  # probe 4: "n_docs": 3 -> 7 loaded silently
    lambda s: s["options"].update(epsilon=0.25),
    lambda s: s["options"].update(max_context_length=40),
    lambda s: s.update(index=None),
    lambda s: s.pop("seal"),
], ids=["n_docs", "epsilon", "max_context_length", "index-null", "seal-removed"])
def test_an_edited_rag_fast_json_is_refused_until_resealed(world, copy_of, change):
    model = copy_of(world["model"])
    side = model / "rag_fast.json"
    _edit(side, change)
    with pytest.raises(ModelDirError) as info:
        RagModel.load(str(model))
    message = str(info.value)
    assert str(side) in message and f"rag-fast reseal {model}" in message, message
    code, err = run_cli("generate", "--model", model, "--question", "which river is rome on",
                        "--num-beams", "1", "--max-new-tokens", "1")
    assert code == 2 and "rag_fast.json" in err and len(err.strip().splitlines()) == 1, err
    code, err = run_cli("reseal", model)
    assert code == 0 and "rag_fast.json" not in err, err
    loaded = RagModel.load(str(model))  # accepted as edited
    after = json.loads(side.read_text())
    assert loaded.n_docs == after["options"]["n_docs"]
    assert loaded.index_path == after["index"]


def test_reseal_never_seals_over_a_corrupt_data_file(world, copy_of):
    model = copy_of(world["model"])
    _edit(model / "rag_fast.json", lambda s: s["options"].update(n_docs=1))
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    code, err = run_cli("reseal", model)
    assert code == 2 and "model.safetensors" in err and "not resealed" in err, err
    with pytest.raises(ModelDirError, match="was changed after rag_fast wrote it"):
        RagModel.load(str(model))


@pytest.mark.parametrize("name", ["../../../../etc/hostname", "/etc/hostname", "a/../b",
                                  "./config.json", "a//b", ""])
def test_files_outside_the_folder_are_refused_before_they_are_opened(world, copy_of, name,
                                                                     monkeypatch):
    """Probe 4: an entry ``../../etc/hostname`` was read and its size reported (an oracle for
    any file the user can read)."""
    from rag_fast.storage import sealed

    model = copy_of(world["model"])
    side = model / "rag_fast.json"
    payload = json.loads(side.read_text())
    payload["files"][name] = {"bytes": 1, "sha256": "0" * 64}
    side.write_text(json.dumps(sealed(payload)))  # even a sealed one
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(os.fspath(file) if isinstance(file, (str, os.PathLike)) else file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    with pytest.raises(ModelDirError, match="expected a relative, normalised path"):
        RagModel.load(str(model))
    assert not any(isinstance(f, str) and "hostname" in f for f in opened)


def test_a_symbolic_link_out_of_the_folder_is_refused(world, copy_of, tmp_path):
    from rag_fast.storage import sealed

    model = copy_of(world["model"])
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    (model / "link.txt").symlink_to(secret)
    side = model / "rag_fast.json"
    payload = json.loads(side.read_text())
    payload["files"]["link.txt"] = {"bytes": 6, "sha256": "0" * 64}
    side.write_text(json.dumps(sealed(payload)))
    with pytest.raises(ModelDirError, match="leads outside"):
        RagModel.load(str(model))


def test_an_int_in_files_is_one_error(world, copy_of):
    """Probe 9: an ``int`` in rag_fast.json's ``files`` gave a traceback."""
    from rag_fast.storage import sealed

    model = copy_of(world["model"])
    side = model / "rag_fast.json"
    payload = json.loads(side.read_text())
    payload["files"]["config.json"] = 5
    side.write_text(json.dumps(sealed(payload)))
    code, err = run_cli("eval", "--data", world["dev"], "--model", model, "--out",
                        model.parent / "e", "--no-progress")
    assert code == 2 and "files.config.json" in err and "Traceback" not in err, err


@pytest.mark.parametrize("part", ["manifest.json", "index/manifest.json",
                                  "passages/manifest.json"])
def test_an_edited_index_manifest_is_refused_until_resealed(world, copy_of, part):
    """Probe 5: editing the encoder's max_length 256 -> 254 in an index's manifest.json was used
    silently by `index search`."""
    from rag_fast.models.retriever_io import load_retriever

    kb = copy_of(world["kb"])
    path = kb / part
    key = {"manifest.json": ("encoder", "max_length"), "index/manifest.json": ("params", None),
           "passages/manifest.json": ("source", None)}[part]

    def change(m):
        if key[0] == "encoder":
            m["encoder"]["max_length"] -= 2
            m["query_encoder"]["max_length"] -= 2
        elif key[0] == "params":
            m["params"]["rerank"] = m["params"].get("rerank", 1) + 1
        else:
            m["source"] = "elsewhere.jsonl"
    _edit(path, change)
    code, err = run_cli("index", "search", kb, "which river is paris on")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "rag-fast reseal" in err, err
    with pytest.raises(StorageError):
        load_retriever(kb)
    target = kb if part == "manifest.json" else path.parent
    code, err = run_cli("reseal", target)  # a part reseals its bundle too
    assert code == 0, err
    assert run_cli("index", "search", kb, "which river is paris on")[0] == 0
    load_retriever(kb)
    if key[0] == "encoder":
        assert json.loads(path.read_text())["query_encoder"]["max_length"] == 30


def test_reseal_of_a_folder_without_a_manifest_is_one_error(tmp_path):
    code, err = run_cli("reseal", tmp_path)
    assert code == 2 and "nothing to reseal" in err, err
    code, err = run_cli("reseal", tmp_path / "missing")
    assert code == 2 and "no such directory" in err, err


def test_reseal_refuses_a_part_of_another_build(world, copy_of, tmp_path):
    """Second hostile pass: `passages/` swapped in from another build (its own seal intact),
    then `rag-fast reseal kb`, sealed the swap and search returned the wrong passages."""
    import shutil

    from conftest import run_cli as cli

    shuffled = tmp_path / "shuffled.jsonl"  # the same ids over other texts, in another order
    lines = world["passages"].read_text().replace("seine", "SWAP").replace("tiber", "seine")
    shuffled.write_text("\n".join(reversed(lines.replace("SWAP", "tiber").splitlines())) + "\n")
    other = tmp_path / "other"
    assert cli("index", "build", "--passages", shuffled, "--encoder", world["encoder"],
               "--out", other, "--no-progress", "--max-length", "32", "--pooling", "mean")[0] == 0
    for part in ("passages", "index"):
        kb = tmp_path / f"kb-{part}"
        shutil.copytree(world["kb"], kb)
        shutil.rmtree(kb / part)
        shutil.copytree(other / part, kb / part)
        before = (kb / "manifest.json").read_bytes()
        code, err = run_cli("reseal", kb)
        assert code == 2 and f"{part}/manifest.json" in err and "another build" in err, (part, err)
        assert (kb / "manifest.json").read_bytes() == before
        assert run_cli("index", "search", kb, "which river is paris on")[0] == 2


def test_a_file_added_to_a_model_directory_is_refused_until_listed(world, copy_of):
    """Second hostile pass: a special_tokens_map.json dropped into a sealed model's tokenizer
    folder changed its EOS and padding with no error."""
    model = copy_of(world["model"])
    added = model / "generator_tokenizer" / "special_tokens_map.json"
    # (the example tokenizer's own start and end tokens, swapped into other roles)
    added.write_text(json.dumps({"eos_token": "<s>", "pad_token": "</s>"}))
    with pytest.raises(ModelDirError) as info:
        RagModel.load(str(model))
    message = str(info.value)
    assert "generator_tokenizer/special_tokens_map.json" in message, message
    assert "does not list" in message and "rag-fast reseal" in message, message
    code, err = run_cli("reseal", model)  # added on purpose: listed, then loaded
    assert code == 0, err
    side = json.loads((model / "rag_fast.json").read_text())
    assert "generator_tokenizer/special_tokens_map.json" in side["files"]
    RagModel.load(str(model))


def test_reseal_refuses_an_unsealed_part_of_another_build_and_finishes_its_own(world,
                                                                            tmp_path):
    """Third hostile pass: a swapped part whose own seal was removed got resealed; and a reseal
    killed after writing a part's manifest left an index that no reseal would accept."""
    import shutil

    from conftest import run_cli as cli
    from rag_fast.storage.manifests import _reseal_file

    other = tmp_path / "other"
    assert cli("index", "build", "--passages", world["passages"], "--encoder", world["encoder"],
               "--out", other, "--no-progress", "--max-length", "32", "--pooling", "mean")[0] == 0
    kb = tmp_path / "kb"
    shutil.copytree(world["kb"], kb)
    shutil.rmtree(kb / "index")
    shutil.copytree(other / "index", kb / "index")
    _edit(kb / "index" / "manifest.json", lambda m: m.pop("seal"))
    code, err = run_cli("reseal", kb)
    assert code == 2 and "another build" in err, err
    # an edit of both parts' manifests, resealed part by part as a killed reseal leaves it
    kb2 = tmp_path / "kb2"
    shutil.copytree(world["kb"], kb2)
    _edit(kb2 / "passages" / "manifest.json", lambda m: m.update(source="edited.jsonl"))
    _edit(kb2 / "index" / "manifest.json", lambda m: m["meta"].update(note=1))
    _reseal_file(kb2 / "index", kb2 / "index" / "manifest.json")  # killed after this write
    code, err = run_cli("reseal", kb2)
    assert code == 0, err
    assert run_cli("index", "search", kb2, "which river is paris on")[0] == 0


def test_reseal_of_a_manifest_holding_nan_names_the_file(world, copy_of):
    model = copy_of(world["model"])
    side = model / "rag_fast.json"
    side.write_text(side.read_text().replace('"epsilon": 0.0', '"epsilon": NaN'))
    code, err = run_cli("reseal", model)
    assert code == 2 and str(side) in err and "NaN" in err, err


def test_reseal_of_an_index_without_part_records_refuses_a_changed_part(world, tmp_path):
    """Final hostile pass: an index directory without the parts' records (an earlier rag_fast's,
    or one whose records were deleted) resealed a part of another build."""
    import shutil

    from conftest import run_cli as cli

    other = tmp_path / "other"
    assert cli("index", "build", "--passages", world["passages"], "--encoder", world["encoder"],
               "--out", other, "--no-progress", "--max-length", "32", "--pooling", "mean")[0] == 0
    kb = tmp_path / "kb"
    shutil.copytree(world["kb"], kb)
    _edit(kb / "manifest.json", lambda m: (m.pop("parts"), m.pop("seal")))
    assert run_cli("reseal", kb)[0] == 0  # unchanged parts: accepted, and recorded now
    assert "parts" in json.loads((kb / "manifest.json").read_text())
    _edit(kb / "manifest.json", lambda m: (m.pop("parts"), m.pop("seal")))
    shutil.rmtree(kb / "index")
    shutil.copytree(other / "index", kb / "index")
    code, err = run_cli("reseal", kb)
    assert code == 2 and "another build" in err, err
