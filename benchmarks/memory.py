"""Absolute memory of one training step, each provider in its own fresh process.

:func:`step_memory` starts a new Python process for one provider and, in it:

1. fixes glibc's mmap threshold at 1 MiB, as the harness does with
   ``RAG_FAST_BENCH_ALLOCATOR=fixed`` (every block of 1 MiB or more is mapped fresh and unmapped
   on free, so a freed temporary leaves the resident set at once): an instrument for memory,
   whatever the parent's setting; nothing is timed in these processes;
2. imports the factory's module (and ``imports``), collects garbage and reads the resident set
   of the bare process (``VmRSS``): the interpreter, torch and the libraries, no model;
3. calls the factory, which builds the model and its optimizer and returns a ``step()``
   callable; runs one warm step, whose gradients the step keeps (it must zero them with
   ``zero_grad(set_to_none=False)`` or not at all), so that the process now holds parameters,
   gradients and optimizer state; reads the resident set again (the baseline);
4. resets the peak resident set (writes ``5`` to ``/proc/self/clear_refs``), runs the measured
   step and reads the peak (``VmHWM``).

Reported (MiB): ``whole_step_peak_mb`` = peak - bare (parameters + gradients + optimizer state
+ whatever the step allocates on top), ``step_extra_mb`` = peak - baseline (the step's own
temporaries and reused buffers beyond the state the warm step left), plus ``state_mb`` =
baseline - bare. Linux only (``/proc``); a child that fails raises :class:`StepMemoryError` with
its error.

:func:`call_fresh`, which it runs on, calls any module-level function in a new process and returns
its (JSON) result: the training bench times each provider that way too
(``bench_training.time_provider``), in processes whose allocator is as glibc sets it by default,
as every bench times (``harness.py``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

_CHILD = ("import sys, json; sys.path[:0] = json.loads(sys.argv[1]); import memory; "
          "memory._fresh_child(sys.argv[2], sys.argv[3])")


class FreshProcessError(RuntimeError):
    """A function called in a fresh process failed there (its error is in the message)."""


class StepMemoryError(FreshProcessError):
    """The provider's process failed (its error is in the message)."""


@dataclass
class StepMemory:
    whole_step_peak_mb: float
    step_extra_mb: float
    state_mb: float
    bare_mb: float

    def to_dict(self) -> dict:
        return asdict(self)


def call_fresh(function: str, *args, path: tuple[str, ...] = (), timeout: float = 1800.0,
               env: dict[str, str] | None = None, label: str | None = None,
               error: type[FreshProcessError] = FreshProcessError, **kwargs):
    """``function(*args, **kwargs)`` (``"module:function"``, a module-level function whose result
    is a JSON value) called in a new Python process; returns that result.

    ``path``: extra ``sys.path`` entries for the child (this folder and the caller's path are
    always there); ``env``: variables set for the child on top of this process's environment;
    ``label``: what the error messages name (default ``function``).

    Raises:
        ValueError: ``function`` not of the form ``"module:function"``, or arguments that are
            not JSON values.
        FreshProcessError (or ``error``): the child failed, timed out or returned no JSON
            value; the message holds the tail of its error output.
    """
    _check_target("function", function)
    label = label or function
    try:
        spec = json.dumps({"function": function, "args": list(args), "kwargs": kwargs})
    except TypeError as e:
        raise ValueError(f"{label}: arguments must be JSON values: {e}") from None
    here = os.path.dirname(os.path.abspath(__file__))
    sys_path = [os.path.abspath(p) for p in path] + [here] + [p for p in sys.path if p]
    fd, out = tempfile.mkstemp(prefix="rag_fast_fresh_", suffix=".json")
    os.close(fd)
    try:
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(sys_path), spec, out],
                                  capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            raise error(f"{label}: the fresh process ran past {timeout:.0f} s") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            raise error(f"{label}: the fresh process failed (exit {proc.returncode}):\n"
                        + "\n".join(tail))
        try:
            with open(out) as f:
                return json.load(f)["result"]
        except (OSError, ValueError, KeyError) as e:
            raise error(f"{label}: the fresh process wrote no result ({e})") from None
    finally:
        os.unlink(out)


def step_memory(factory: str, *args, imports: tuple[str, ...] = (), path: tuple[str, ...] = (),
                timeout: float = 1800.0, **kwargs) -> StepMemory:
    """Memory of one step of the provider ``factory(*args, **kwargs)`` (``"module:function"``,
    a module-level function returning ``step()``), measured in a fresh process.

    ``imports``: modules imported before the bare resident set is read (so that the libraries a
    provider loads lazily count as the process, not as its model); ``path``: extra ``sys.path``
    entries for the child. Arguments must be JSON values.

    Raises:
        ValueError: ``factory`` not of the form ``"module:function"``, or arguments that are not
            JSON values.
        StepMemoryError: the child failed (or timed out); the message holds its error.
    """
    _check_target("factory", factory)
    if not sys.platform.startswith("linux"):
        raise StepMemoryError("step memory reads /proc/self (Linux only)")
    result = call_fresh("memory:_measure_step", factory, list(args), kwargs, list(imports),
                        path=path, timeout=timeout, label=factory, error=StepMemoryError)
    return StepMemory(**result)


def _status_kb(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise StepMemoryError(f"/proc/self/status has no {name}")


def _check_target(argument: str, target) -> None:
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"{argument} must be 'module:function', got {target!r}")


def _resolve(target: str):
    """The function ``"module:function"`` names (imported in this process)."""
    import importlib

    module_name, function = target.split(":")
    fn = getattr(importlib.import_module(module_name), function, None)
    if not callable(fn):
        raise FreshProcessError(f"{module_name} has no function {function!r}")
    return fn


def _fresh_child(spec_json: str, out: str) -> None:
    """Runs in the fresh process of :func:`call_fresh`: the call, its result written atomically."""
    spec = json.loads(spec_json)
    result = _resolve(spec["function"])(*spec["args"], **spec["kwargs"])
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump({"result": result}, f)
    os.replace(tmp, out)


def _measure_step(factory: str, args: list, kwargs: dict, imports: list[str]) -> dict:
    """Runs in the fresh process of :func:`step_memory` (see the module docstring)."""
    import gc
    import importlib

    from harness import _fix_malloc_mmap_threshold

    _fix_malloc_mmap_threshold()  # whatever the parent's setting: the measurement needs it
    for name in imports:
        importlib.import_module(name)
    make = _resolve(factory)
    gc.collect()
    bare = _status_kb("VmRSS")
    step = make(*args, **kwargs)
    step()  # warm: gradients, optimizer state and reused buffers now exist
    gc.collect()
    baseline = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    step()
    peak = _status_kb("VmHWM")
    return {"whole_step_peak_mb": (peak - bare) / 1024, "step_extra_mb": (peak - baseline) / 1024,
            "state_mb": (baseline - bare) / 1024, "bare_mb": bare / 1024}
