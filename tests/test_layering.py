"""The package's layering (docs/architecture.md), read from the source's imports:

- no import cycle between rag_fast's first-level packages and modules, nor between its files;
- a ``rag_fast`` import inside a function only for an optional dependency, with a
  ``# deferred: <reason>`` comment;
- no module imports another first-level package's private (``_name``) module, nor a private
  name from another module;
- no library module imports the command line;
- no file over 900 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rag_fast

PACKAGE = Path(rag_fast.__file__).resolve().parent
MAX_DEFERRED = 2  # issue 47: only imports of an optional dependency (Triton) wait for a call
MAX_LINES = 900  # issue 47: no file of rag_fast longer


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield path, parts


def _imports(path: Path, parts: tuple[str, ...]):
    """(node, absolute target names, inside a function) for each import of rag_fast."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    package = parts if path.name == "__init__.py" else parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        targets = [t for t in targets if t == "rag_fast" or t.startswith("rag_fast.")]
        if not targets:
            continue
        p, in_function = parents.get(node), False
        while p is not None:
            if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function = True
                break
            p = parents.get(p)
        yield node, targets, in_function


def _first_level(name_parts) -> str:
    return name_parts[1] if len(name_parts) > 1 else ""


def _graph():
    edges: dict[str, set[str]] = {}
    for path, parts in _modules():
        me = _first_level(parts)
        for _, targets, _ in _imports(path, parts):
            for t in targets:
                other = _first_level(t.split("."))
                if other and me and other != me:
                    edges.setdefault(me, set()).add(other)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_cycle_between_first_level_packages():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_deferred_imports_are_few_and_give_their_reason():
    deferred, unexplained, reasons = [], [], []
    for path, parts in _modules():
        lines = path.read_text(encoding="utf-8").splitlines()
        for node, _, in_function in _imports(path, parts):
            if not in_function:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            deferred.append(where)
            around = lines[node.lineno - 2: node.end_lineno]
            said = [line.split("# deferred:", 1)[1] for line in around if "# deferred:" in line]
            if not said:
                unexplained.append(where)
            reasons.extend((where, reason) for reason in said)
    assert not unexplained, f"deferred imports without a '# deferred: reason' comment: {unexplained}"
    assert len(deferred) <= MAX_DEFERRED, deferred
    not_optional = [w for w, reason in reasons if "optional dependency" not in reason]
    assert not not_optional, f"deferred imports of what is no optional dependency: {not_optional}"


def test_no_import_of_another_packages_private_module():
    bad = []
    for path, parts in _modules():
        me = _first_level(parts)
        for node, targets, _ in _imports(path, parts):
            for t in targets:
                names = t.split(".")
                other = _first_level(names)
                # rag_fast.<pkg>...._private...: a private module or name of another package
                private = [n for n in names[2:] if n.startswith("_") and not n.startswith("__")]
                if other != me and not other.startswith("_") and private:
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {t}")
    assert not bad, bad


@pytest.mark.parametrize("forbidden", ["rag_fast.cli"])
def test_no_library_module_imports_the_command_line(forbidden):
    bad = []
    for path, parts in _modules():
        if _first_level(parts) == "cli":
            continue
        for node, targets, _ in _imports(path, parts):
            if any(t == forbidden or t.startswith(forbidden + ".") for t in targets):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not bad, bad


def test_training_and_decoding_import_without_faiss():
    """A GPU image may carry no faiss: what trains and decodes imports without it, and the
    index names faiss when it is first needed."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['faiss'] = None\n"
            "import rag_fast.models, rag_fast.training, rag_fast.generation, rag_fast.cli\n"
            "from rag_fast.retrieval import DenseIndex\n"
            "import numpy as np\n"
            "try:\n"
            "    DenseIndex.build(np.zeros((8, 4), dtype='float32'))\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rag_fast's index needs faiss" in proc.stdout


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _file_imports():
    """(file, line, importing module, imported module, imported name or None) for each
    module-level import of rag_fast (annotation-only imports left out): a target
    ``rag_fast.a.b.name`` resolves to the longest module prefix, the rest is the name."""
    modules = {".".join(parts) for _, parts in _modules()}
    for path, parts in _modules():
        skip = _type_checking_lines(ast.parse(path.read_text(encoding="utf-8")))
        me = ".".join(parts)
        for node, targets, in_function in _imports(path, parts):
            if in_function or node.lineno in skip:
                continue
            for target in targets:
                names = target.split(".")
                cut = next(i for i in range(len(names), 0, -1) if ".".join(names[:i]) in modules)
                rest = names[cut:]
                yield (path, node.lineno, me, ".".join(names[:cut]), rest[0] if rest else None)


def test_no_import_circle_between_files():
    edges: dict[str, set[str]] = {}
    for _, _, me, module, _ in _file_imports():
        if module != me:
            edges.setdefault(me, set()).add(module)
    assert _cycles(edges) == []


def test_no_private_name_imported_from_another_module():
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} {module}.{name}"
           for path, line, me, module, name in _file_imports()
           if module != me and name and name.startswith("_") and not name.startswith("__")]
    assert not bad, bad


def test_no_file_is_over_900_lines():
    long = {str(path.relative_to(PACKAGE.parent)): n for path, _ in _modules()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, long
