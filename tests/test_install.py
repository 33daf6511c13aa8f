"""Installing from a checkout: builds that follow each other in one checkout, and what a user
meets when Python imports the checkout's rag_fast/ (no compiled extension) instead of the
installed package."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import rag_fast
from rag_fast import _ext
from utils import IN_CI

ROOT = Path(__file__).resolve().parents[1]
# What a build reads (pyproject.toml names README.md as the long description).
BUILD_INPUTS = ["setup.py", "CMakeLists.txt", "pyproject.toml", "README.md", "csrc", "rag_fast"]
NOT_SOURCES = shutil.ignore_patterns("__pycache__", "*.pyc", "_C.*.so", "_C.*.pyd", "_C.so")


def _copy_checkout(dest: Path, names: list[str]) -> Path:
    """``names`` from this checkout into ``dest``, without compiled or cached files."""
    dest.mkdir()
    for name in names:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=NOT_SOURCES)
        else:
            shutil.copy2(src, dest / name)
    return dest


# A developer's editable install of the real checkout adds a finder that would serve its _C
# to the copy; the copy must be on its own, as a plain checkout is.
_NO_EDITABLE_FINDERS = """
import sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
"""

_IMPORT_FROM_CHECKOUT = _NO_EDITABLE_FINDERS + """
import json, warnings
import torch

with warnings.catch_warnings(record=True) as at_import:
    warnings.simplefilter("always")
    import rag_fast
with warnings.catch_warnings(record=True) as at_use:
    warnings.simplefilter("always")
    x = torch.randn(2, 3, 4, 5); s = torch.randn(2, 3); y = torch.randint(0, 5, (2, 4))
    for _ in range(2):
        loss = rag_fast.rag_token_nll(x, s, y)  # impl="auto": falls back to the reference
assert torch.equal(loss, rag_fast.reference.rag_token_nll(x, s, y))

def ours(caught):
    return [(w.category.__name__, issubclass(w.category, RuntimeWarning), str(w.message))
            for w in caught if "rag_fast C++ extension" in str(w.message)]

print(json.dumps({"file": rag_fast.__file__, "at_import": ours(at_import), "at_use": ours(at_use)}))
"""


def test_source_checkout_without_extension_says_where_and_how_to_fix(tmp_path):
    """Python started in a checkout imports its rag_fast/, which has no _C: one warning, at
    ``import rag_fast`` as the README says (a newcomer saw none, since it came only at the first
    op), names that path and both fixes; `python -m rag_fast.info` prints the same."""
    checkout = _copy_checkout(tmp_path / "checkout", ["setup.py", "CMakeLists.txt", "rag_fast"])
    package = checkout / "rag_fast"
    # no Triton interpreter: "auto" then falls back to the reference, which the script checks
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_FROM_CHECKOUT], cwd=checkout, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert Path(result["file"]).resolve().parent == package.resolve()
    assert len(result["at_import"]) == 1, result["at_import"]  # at import
    assert result["at_use"] == []  # and once only
    category, is_runtime_warning, message = result["at_import"][0]
    assert category == "SourceTreeWarning" and is_runtime_warning
    assert issubclass(_ext.SourceTreeWarning, RuntimeWarning)
    for expected in (str(package.resolve()), "no compiled extension", "reference kernels",
                     "`pip install -e .`", "outside this checkout"):
        assert expected in message, f"{expected!r} not in {message!r}"
    if _ext.available() and "site-packages" in rag_fast.__file__:  # an installed rag_fast
        # (as in CI; not an editable install's checkout): the warning points at it
        assert str(Path(rag_fast.__file__).resolve().parent) in message

    info = subprocess.run([sys.executable, "-c", _NO_EDITABLE_FINDERS + "import runpy; "
                           "runpy.run_module('rag_fast.info', run_name='__main__')"], cwd=checkout,
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "UNAVAILABLE" in info.stdout
    assert f"WARNING: {message}" in info.stdout  # the same explanation, in the output itself
    assert info.stderr.count("SourceTreeWarning") <= 1  # (the import's), not once per use


def _missing_build_requirements() -> list[str]:
    """pyproject.toml's [build-system] requirements that this environment does not satisfy."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    missing = []
    for text in pyproject["build-system"]["requires"]:
        requirement = Requirement(text)
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(text)
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            missing.append(text)
    return missing


def _pip_wheel(source: Path, wheels: Path, env: dict[str, str]) -> list[str]:
    """`pip wheel` the checkout with this environment's build tools, offline; the wheel holds
    the compiled extension. Returns the wheel's file names."""
    wheels.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
         "--wheel-dir", str(wheels), str(source)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    (wheel,) = wheels.glob("rag_fast-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("rag_fast/_C.") and n.endswith((".so", ".pyd")) for n in names), names
    return names


@pytest.mark.slow
def test_rebuild_after_the_build_environment_is_gone(tmp_path):
    """`pip install .` builds with cmake, ninja and pybind11 from a temporary environment that pip
    deletes afterwards; the next build in the same checkout (README: the run command, then the
    test command) must not trip over the CMake cache that points there nor ship a module deleted
    since, and a build in an unchanged environment recompiles nothing."""
    missing = _missing_build_requirements()
    if missing:
        reason = f"an offline build needs the build requirements: pip install {' '.join(missing)}"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    scripts = sysconfig.get_path("scripts")
    search = os.pathsep.join([scripts, os.environ.get("PATH", "")])
    ninja = shutil.which("ninja", path=search)
    cmake = shutil.which("cmake", path=search)
    assert ninja and cmake, "the ninja and cmake packages are installed but not on PATH"
    pybind11 = Path(importlib.util.find_spec("pybind11").origin).parent

    source = _copy_checkout(tmp_path / "checkout", BUILD_INPUTS)
    base_env = {**os.environ, "PATH": search, "RAG_FAST_DISABLE_SIMD": "1"}  # one kernel variant

    # A stand-in for pip's isolated build environment: its own bin/ (ninja, cmake) first on PATH
    # and its own pybind11 first on sys.path, deleted once the build is done.
    build_env = tmp_path / "pip-build-env"
    (build_env / "bin").mkdir(parents=True)
    (build_env / "site").mkdir()
    (build_env / "bin" / "ninja").symlink_to(ninja)
    (build_env / "bin" / "cmake").symlink_to(cmake)
    (build_env / "site" / "pybind11").symlink_to(pybind11, target_is_directory=True)
    removed = source / "rag_fast" / "_removed_later.py"
    removed.write_text("")
    names = _pip_wheel(source, tmp_path / "wheels-1", {
        **base_env,
        "PATH": os.pathsep.join([str(build_env / "bin"), search]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(build_env / "site"),
                                                    os.environ.get("PYTHONPATH")])),
    })
    assert "rag_fast/_removed_later.py" in names
    shutil.rmtree(build_env)
    removed.unlink()

    names = _pip_wheel(source, tmp_path / "wheels-2", base_env)  # the old setup.py failed here
    assert "rag_fast/_removed_later.py" not in names  # setuptools never cleans build/lib itself
    objects = {p: p.stat().st_mtime_ns for p in (source / "build").rglob("*.o")}
    assert objects, "no object files under build/"

    _pip_wheel(source, tmp_path / "wheels-3", base_env)  # same environment: incremental
    recompiled = [p for p, t in objects.items() if not p.exists() or p.stat().st_mtime_ns != t]
    assert not recompiled, f"an unchanged build environment recompiled {recompiled}"
