"""The package's layers: every module imports only from its own layer or those before it, and no
import cycle exists between modules, counting imports made inside functions (which keep Python
from failing but do not make the layering true). The order is the one in jaxllm/__init__.py."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxllm"

# Earlier layers first; a module belongs to the first entry that is it or a package above it.
LAYERS = ["jaxllm.env", "jaxllm.checks", "jaxllm.runtime", "jaxllm.layers", "jaxllm.kernels", "jaxllm.model", "jaxllm.families", "jaxllm.io",
          "jaxllm.text", "jaxllm.engine", "jaxllm.tools", "jaxllm", "jaxllm.server", "jaxllm.cli", "jaxllm.__main__"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    """The index in LAYERS of `module`'s layer: the longest entry that is it or a package above it."""
    best = max((entry for entry in LAYERS if module == entry or module.startswith(entry + ".")), key=len)
    return LAYERS.index(best)


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported jaxllm module, line) for each import in `path`, inside functions too.
    `from jaxllm.x import y` counts as importing jaxllm.x.y where that is a module, else jaxllm.x."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                found.append((f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, node.lineno))
    return [(name, line) for name, line in found if name in MODULES and name != module]


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_layers_cover_every_module():
    assert "jaxllm.kernels" in MODULES and "jaxllm.engine.generate" in MODULES  # the walk found the package
    for m in MODULES:
        assert any(m == e or m.startswith(e + ".") for e in LAYERS), f"{m} is in no layer of LAYERS"


def test_no_module_imports_a_later_layer():
    upward = [f"{MODULES[m].relative_to(PACKAGE.parent)}:{line} imports {name} "
              f"({LAYERS[_layer(name)]} comes after {LAYERS[_layer(m)]})"
              for m, edges in GRAPH.items() for name, line in edges if _layer(name) > _layer(m)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def _cycle(graph: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for name, _ in graph[m]:
            if state.get(name) == "open":
                return stack[stack.index(name):] + [name]
            if name not in state and (found := visit(name)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in graph:
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {next(line for n, line in GRAPH[a] if n == b)})" for a, b in zip(cycle, cycle[1:])) \
        + f" -> {cycle[-1]}"


@pytest.mark.parametrize("source, message", [
    ({"jaxllm.model.cache": ["jaxllm.engine.memory"], "jaxllm.engine.memory": []}, "against the layer order"),
    ({"jaxllm.io.loader": ["jaxllm.io.checkpoint"], "jaxllm.io.checkpoint": ["jaxllm.io.loader"]}, "cycle"),
])
def test_the_checks_fail_on_a_bad_import(source, message):
    """The checks above catch an upward import and a cycle within one layer (they can fail)."""
    graph = {m: [(n, 1) for n in names] for m, names in source.items()}
    upward = [(m, n) for m, edges in graph.items() for n, _ in edges if _layer(n) > _layer(m)]
    assert bool(upward) == (message == "against the layer order")
    assert (_cycle(graph) is not None) == (message == "cycle")
