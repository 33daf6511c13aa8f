"""Build driver: setuptools hands the `rag_fast._C` extension to CMake.

Build switches (environment variables):
  RAG_FAST_BUILD_TYPE   CMake build type (default Release).
  RAG_FAST_OPENMP       1 (default) to use OpenMP when the compiler has it, 0 to use one thread.
  RAG_FAST_NATIVE       1 to add -march=native (only for wheels used on the build machine).
  RAG_FAST_DISABLE_SIMD 1 to build only the portable kernel variant (no AVX2/AVX-512 variants).
  RAG_FAST_CMAKE_ARGS   extra arguments passed to CMake verbatim (space separated).
  RAG_FAST_JOBS         parallel build jobs (default: number of CPUs).

CMake build folders: ``build/cmake-<key>/``, one per build environment. The key hashes what a
CMake cache remembers (Python, cmake, ninja, pybind11, source folder, build type and switches),
so a folder is only ever reused by the same environment: `pip install -e . --no-build-isolation`
in a stable venv rebuilds incrementally, while each `pip install .` (build isolation: pip's
temporary cmake/ninja/pybind11) gets a fresh folder. A folder whose tools no longer exist (pip
deleted that build environment) is removed before the build.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CMAKE_BUILDS = ROOT / "build"
ENV_FILE = "rag_fast-build-env.json"  # in each build/cmake-<key>/: the environment it belongs to
TOOL_KEYS = ("python", "cmake", "ninja", "pybind11_dir")  # paths that vanish with a build env


def _flag(name: str, default: str) -> str:
    value = os.environ.get(name, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return "ON" if value == "1" else "OFF"


def _cmake_executable() -> str:
    """The build environment's cmake (the `cmake` package pyproject.toml requires), else PATH's."""
    try:
        import cmake

        exe = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if exe.is_file():
            return str(exe)
    except ImportError:
        pass
    found = shutil.which("cmake")
    if found is None:
        raise RuntimeError("rag_fast needs CMake >= 3.18 to build: `pip install cmake`")
    return found


def _ninja_executable() -> str:
    """Ninja from PATH (pip puts the build environment's scripts first), or "" to use make."""
    found = shutil.which("ninja")
    if found is None:
        try:
            import ninja

            candidate = Path(ninja.BIN_DIR) / "ninja"
            found = str(candidate) if candidate.is_file() else None
        except ImportError:
            pass
    return found or ""


def _remove_stale_builds() -> None:
    """Delete build/cmake-*/ folders whose build environment is gone (their CMake cache points
    at a cmake, ninja or pybind11 that no longer exists, so CMake would fail on them) or that
    were copied here with the checkout."""
    for folder in CMAKE_BUILDS.glob("cmake-*"):
        try:
            env = json.loads((folder / ENV_FILE).read_text())
            stale = env["source_dir"] != str(ROOT) or any(
                env[k] and not os.path.exists(env[k]) for k in TOOL_KEYS
            )
        except (OSError, ValueError, KeyError, TypeError):  # not written by this setup.py
            stale = True
        if stale:
            shutil.rmtree(folder, ignore_errors=True)


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path) -> None:
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        import pybind11  # provided by the build environment (pyproject.toml)

        cmake, ninja = _cmake_executable(), _ninja_executable()
        env = {
            "python": sys.executable,
            "cmake": cmake,
            "ninja": ninja,
            "pybind11_dir": pybind11.get_cmake_dir(),
            "source_dir": ext.source_dir,
            "build_type": os.environ.get("RAG_FAST_BUILD_TYPE", "Release"),
            "switches": [
                f"-DRAG_FAST_OPENMP={_flag('RAG_FAST_OPENMP', '1')}",
                f"-DRAG_FAST_NATIVE={_flag('RAG_FAST_NATIVE', '0')}",
                f"-DRAG_FAST_DISABLE_SIMD={_flag('RAG_FAST_DISABLE_SIMD', '0')}",
                *shlex.split(os.environ.get("RAG_FAST_CMAKE_ARGS", "")),
            ],
        }
        key = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
        _remove_stale_builds()
        build_dir = CMAKE_BUILDS / f"cmake-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / ENV_FILE).write_text(json.dumps(env, indent=2) + "\n")

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}{os.sep}",
            f"-DPython_EXECUTABLE={env['python']}",
            f"-Dpybind11_DIR={env['pybind11_dir']}",
            f"-DCMAKE_BUILD_TYPE={env['build_type']}",
            *env["switches"],
        ]
        if ninja:
            cmake_args += ["-GNinja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        jobs = os.environ.get("RAG_FAST_JOBS", str(os.cpu_count() or 1))
        subprocess.run([cmake, "-S", ext.source_dir, "-B", str(build_dir), *cmake_args], check=True)
        subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True)


class CleanBuildPy(build_py):
    """Copy the package into a clean build/lib: setuptools never deletes there, so a module
    removed or renamed in the source would otherwise live on in the next `pip install .`."""

    def run(self) -> None:
        for package in self.packages or ():
            if "." not in package:
                shutil.rmtree(Path(self.build_lib) / package, ignore_errors=True)
        super().run()


setup(
    ext_modules=[CMakeExtension("rag_fast._C", ROOT)],
    cmdclass={"build_ext": CMakeBuild, "build_py": CleanBuildPy},
)
