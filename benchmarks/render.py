"""Markdown tables from benchmark results. ``python benchmarks/render.py FILE [FILE ...]`` prints
any results file of ``run.py`` (a local run's, under ``benchmarks/results/local/``) as the README
shows it, on stdout. Without files it rewrites the README's generated sections from the JSON
committed under ``benchmarks/results/``; ``--check`` only compares and exits 1, naming every
section that differs from what its JSON renders to (or is missing).

A generated section sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``.
:data:`SECTIONS` maps each NAME to its results file and the module whose
``render(results, source) -> str`` turns that file into the section's Markdown: a bench
(``benchmarks/bench_*.py``) or an example (``examples/*.py``) that writes its own results.
Adding a section: one line here, the two markers in the README, then run this script.
:data:`DOCS_SECTIONS` does the same for ``docs/benchmarks.md`` (runs on other machines);
``--check`` and a rewrite cover both files.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MODULE_DIRS = (HERE, ROOT / "examples")  # where a renderer's module is looked up, in order

# section NAME -> (results file under benchmarks/results/, module defining render)
SECTIONS: dict[str, tuple[str, str]] = {
    "losses": ("cpu-losses-full.json", "bench_losses"),
    "training": ("cpu-training-full.json", "bench_training"),
    "contention": ("cpu-contention-full.json", "bench_contention"),
    "lm_head": ("cpu-lm-head-full.json", "bench_lm_head"),
    "decoding": ("cpu-decoding-full.json", "bench_decoding"),
    "index": ("cpu-index-full.json", "bench_index"),
    "distributed": ("cpu-distributed-full.json", "bench_distributed"),
    "knowledge-swap": ("knowledge-swap.json", "knowledge_swap"),
    "knowledge-swap-causal": ("knowledge-swap-causal.json", "knowledge_swap"),
}

# The same for docs/benchmarks.md ("Other machines"): runs on CPUs other than the README's,
# and with instruction sets capped to stand in for older CPUs.
DOCS_FILE = "docs/benchmarks.md"
DOCS_SECTIONS: dict[str, tuple[str, str]] = {
    "losses-xeon": ("cpu-full.json", "bench_losses"),
    "training-epyc": ("cpu-training-epyc.json", "bench_training"),
    "decoding-epyc": ("cpu-decoding-epyc.json", "bench_decoding"),
    "decoding-epyc-avx2": ("cpu-decoding-epyc-avx2.json", "bench_decoding"),
    # where a training step's time goes (benchmarks/profile_training.py)
    "training-profile": ("cpu-training-profile.json", "profile_training"),
    # the step's optional mechanisms one at a time (benchmarks/step_variants.py)
    "step-variants": ("cpu-step-variants.json", "step_variants"),
}


def _module(name: str):
    """The module ``name`` from the first of :data:`MODULE_DIRS` that has ``name.py``."""
    if name in sys.modules:
        return sys.modules[name]
    if str(HERE) not in sys.path:  # the benches import the harness as a top-level module
        sys.path.insert(0, str(HERE))
    for folder in MODULE_DIRS:
        path = folder / f"{name}.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up while it executes
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
    raise ModuleNotFoundError(f"no {name}.py in {', '.join(map(str, MODULE_DIRS))}")


def rendered(name: str) -> str:
    """Section ``name`` as its committed results file renders it."""
    source, module = SECTIONS[name] if name in SECTIONS else DOCS_SECTIONS[name]
    with open(RESULTS / source, encoding="utf-8") as f:
        results = json.load(f)
    return _module(module).render(results, source)


def _pattern(name: str) -> re.Pattern:
    n = re.escape(name)
    return re.compile(rf"<!-- bench:{n} -->\n(.*?)\n?<!-- /bench:{n} -->", re.S)


def _markers(name: str, section: str) -> str:
    return f"<!-- bench:{name} -->\n{section}\n<!-- /bench:{name} -->"


def readme_section(text: str, name: str) -> str | None:
    """The text between section ``name``'s markers (each on its own line), or None when the
    README lacks them."""
    m = _pattern(name).search(text)
    return None if m is None else m.group(1)


def _update(path: str, sections: dict[str, tuple[str, str]], check: bool) -> bool:
    """Compare (``check``) or rewrite the generated sections of the file ``path``; print every
    section that is missing or differs. True when the file is as its results render."""
    text = pathlib.Path(path).read_text(encoding="utf-8")
    missing = [name for name in sections if readme_section(text, name) is None]
    for name in missing:
        print(f"{path}: no section {name!r} (<!-- bench:{name} --> ... <!-- /bench:{name} -->) "
              f"for benchmarks/results/{sections[name][0]}", file=sys.stderr)
    new, differing = text, []
    for name in sections:
        if name in missing:
            continue
        try:
            section = rendered(name)
        except FileNotFoundError as e:  # the results file was not committed (or was renamed)
            print(f"section {name!r}: {e}", file=sys.stderr)
            missing.append(name)
            continue
        if readme_section(text, name) != section:
            differing.append(name)
            new = _pattern(name).sub(lambda m, name=name, s=section: _markers(name, s), new)
    if check:
        for name in differing:
            print(f"{path}: section {name!r} differs from what benchmarks/results/"
                  f"{sections[name][0]} renders to (run python benchmarks/render.py)",
                  file=sys.stderr)
        return not (missing or differing)
    if missing:  # nothing written: a section without its place is the file's mistake
        return False
    if new != text:
        tmp = f"{path}.tmp.{os.getpid()}"
        pathlib.Path(tmp).write_text(new, encoding="utf-8")
        os.replace(tmp, path)
        print(f"updated {path}: {', '.join(differing)}")
    return True


def render_file(path: str) -> str:
    """Every bench of a results file (``run.py``'s JSON), each as its ``render`` shows it (the
    README's tables and captions), in the file's order.

    Raises:
        ValueError: the file is not a results file (no ``rows``, or rows without ``bench``),
            naming the file.
    """
    with open(path, encoding="utf-8") as f:
        try:
            results = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    rows = results.get("rows") if isinstance(results, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "bench" in r for r in rows):
        raise ValueError(f"{path}: not a benchmarks/run.py results file (expected an object "
                         "with \"rows\", each naming its \"bench\")")
    parts = []
    for bench in dict.fromkeys(r["bench"] for r in rows):
        mine = {**results, "rows": [r for r in rows if r["bench"] == bench]}
        try:
            module = _module(f"bench_{bench.replace('-', '_')}")
        except ModuleNotFoundError:
            raise ValueError(f"{path}: rows of a bench {bench!r} that has no "
                             f"benchmarks/bench_{bench}.py to render them") from None
        parts.append(f"## {bench}\n\n" + module.render(mine, path))
    if not parts:
        raise ValueError(f"{path}: the file holds no rows")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="results files to print as Markdown (leaves the README alone)")
    parser.add_argument("--check", action="store_true",
                        help="only compare; exit 1 naming every section that differs")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument("--docs", default=str(ROOT / DOCS_FILE),
                        help=f"the file of DOCS_SECTIONS (default {DOCS_FILE})")
    args = parser.parse_args(argv)
    if args.files:
        if args.check:
            parser.error("--check compares the README with the committed results; it takes no FILE")
        for path in args.files:
            try:
                sys.stdout.write(render_file(path))
            except (OSError, ValueError) as e:
                print(f"render.py: {e}", file=sys.stderr)
                return 1
        return 0
    ok = _update(args.readme, SECTIONS, args.check)
    ok = _update(args.docs, DOCS_SECTIONS, args.check) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
