"""The package's layers import downwards only, no import circle exists, and no module is over
600 lines.

`ops` (formulas) ← `models` ← `rollout` ← `algorithms` ← `parallel` ← `runs` ← `train`: a
module of one layer imports modules of its own layer or of those before it. Every import
counts, at module level, inside a function or under `TYPE_CHECKING` alike (the source is
read, nothing is imported). The modules outside the layers (`data`, `rewards`, `monitor`,
`runlog`, ...) must not form circles either.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxrlhf"
LAYERS = ("ops", "models", "rollout", "algorithms", "parallel", "runs", "train")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports (`from a.b import c` is `a.b.c` when that
    is a module, else `a.b`)."""
    modules = _modules()

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names if a.name.startswith("jaxrlhf.")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("jaxrlhf"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in modules else known(node.module))
        graph[name] = deps - {name, "jaxrlhf"}
    return graph


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_layers_import_downwards_only():
    upward = [f"{m} imports {d}" for m, deps in sorted(import_graph().items()) for d in sorted(deps)
              if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]
    assert upward == []


def test_the_checks_see_a_circle_and_an_upward_import():
    graph = {"jaxrlhf.ops.a": {"jaxrlhf.models.b"}, "jaxrlhf.models.b": {"jaxrlhf.ops.a"}}
    assert circles(graph) == [["jaxrlhf.models.b", "jaxrlhf.ops.a"]]
    assert layer("jaxrlhf.ops.a") < layer("jaxrlhf.models.b")
    assert "jaxrlhf.algorithms.ppo_config" in import_graph()["jaxrlhf.algorithms.ppo"]


def test_no_module_over_600_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}, "split these modules: " + ", ".join(f"{k} ({v} lines)" for k, v in sorted(long.items()))
