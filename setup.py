"""Build driver: setuptools hands the `rag_fast._C` extension to CMake.

Build switches (environment variables):
  RAG_FAST_BUILD_TYPE   CMake build type (default Release).
  RAG_FAST_OPENMP       1 (default) to use OpenMP when the compiler has it, 0 to use one thread.
  RAG_FAST_NATIVE       1 to add -march=native (only for wheels used on the build machine).
  RAG_FAST_DISABLE_SIMD 1 to build only the portable kernel variant (no AVX2/AVX-512 variants).
  RAG_FAST_CMAKE_ARGS   extra arguments passed to CMake verbatim (space separated).
  RAG_FAST_JOBS         parallel build jobs (default: number of CPUs).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _flag(name: str, default: str) -> str:
    value = os.environ.get(name, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return "ON" if value == "1" else "OFF"


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path) -> None:
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        import pybind11  # provided by the build environment (pyproject.toml)

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_type = os.environ.get("RAG_FAST_BUILD_TYPE", "Release")
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DRAG_FAST_OPENMP={_flag('RAG_FAST_OPENMP', '1')}",
            f"-DRAG_FAST_NATIVE={_flag('RAG_FAST_NATIVE', '0')}",
            f"-DRAG_FAST_DISABLE_SIMD={_flag('RAG_FAST_DISABLE_SIMD', '0')}",
        ]
        cmake_args += shlex.split(os.environ.get("RAG_FAST_CMAKE_ARGS", ""))
        try:
            import ninja  # noqa: F401

            cmake_args.append("-GNinja")
        except ImportError:
            pass
        jobs = os.environ.get("RAG_FAST_JOBS", str(os.cpu_count() or 1))
        build_temp = Path(self.build_temp) / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", ext.source_dir, *cmake_args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_temp, check=True)


setup(
    ext_modules=[CMakeExtension("rag_fast._C", ROOT)],
    cmdclass={"build_ext": CMakeBuild},
)
