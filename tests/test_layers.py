"""The package's import structure: the layer contracts of pyproject.toml ([tool.importlinter],
run by import-linter itself), no import cycle between kvserve modules (function-local imports
included), and function-local imports only for heavy optional dependencies, each with its reason."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def _cycles(graph: grimp.ImportGraph) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(adj[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(adj[child])))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.add(frozenset(comp))
    return found


def test_layer_contracts_hold():
    # In a process of its own: import-linter configures logging, disabling every logger that
    # exists (later tests read kvserve's log records).
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_no_import_cycles():
    cycles = _cycles(grimp.build_graph("kvserve", cache_dir=None))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    class Graph:
        modules = {"a", "b", "c"}

        @staticmethod
        def find_modules_directly_imported_by(m):
            return {"a": {"b"}, "b": {"a"}, "c": {"a"}}[m]

    assert _cycles(Graph()) == {frozenset({"a", "b"})}


# What a function may import for itself (outside the command-line files, which import each
# command's module when it runs): heavy dependencies that only some users install, xgrammar
# (it imports transformers: loaded once a constrained request comes) and the replicas' Ray side.
DEFERRED = ("transformers", "matplotlib", "triton", "kvserve.kernels.triton_", "xgrammar",
            "kvserve.server.replicas.pool")


def _local_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, source text) of each import inside a function of `path`."""
    src = path.read_text()
    found = {}
    for fn in ast.walk(ast.parse(src)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [f"{node.module}.{a.name}" if node.module == "kvserve.kernels" else node.module
                             for a in node.names]
                else:
                    continue
                found[node.lineno] = (names, ast.get_source_segment(src, node, padded=False))
    return [(line, name, text) for line, (names, text) in sorted(found.items()) for name in names]


def test_function_local_imports_only_defer_optional_dependencies_with_a_reason():
    src_lines = {}
    bad = []
    for path in sorted((ROOT / "kvserve").rglob("*.py")):
        if path.name == "cli.py":
            continue
        lines = src_lines.setdefault(path, path.read_text().splitlines())
        for line, name, text in _local_imports(path):
            span = lines[line - 1:line - 1 + text.count("\n") + 1]
            if not name.startswith(DEFERRED) or not any("#" in s for s in span):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {text.splitlines()[0]}")
    assert not bad, "function-local imports without a deferred optional dependency and its reason:\n" + "\n".join(bad)


def test_the_local_import_finder_sees_nested_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    if x:\n        from kvserve.kernels import (\n            triton_ops,  # why\n        )\n"
                 "    import json\n")
    assert [(n, name) for n, name, _ in _local_imports(f)] == [(3, "kvserve.kernels.triton_ops"), (6, "json")]
