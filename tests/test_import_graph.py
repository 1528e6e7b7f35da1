"""The package's layering (issue #21), read from the modules' own import statements: formats below kernels below
codecs below the engine, no import circles, and the engine free of model surgery and integrations."""
import ast
from pathlib import Path

import lightning_act

PACKAGE = Path(lightning_act.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports at module level or inside functions (``from .x import y`` names module
    ``x.y`` when that is a module, else ``x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    # a package's __init__ re-exporting its children is not a dependency of the children on it
    return {module_name(p): {m for m in imported_modules(p, modules) if not module_name(p).startswith(m + ".")}
            for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_lower_layers_never_import_upper_ones():
    graph = import_graph()
    layers = {"lightning_act.formats": 0, "lightning_act.cuda": 1, "lightning_act.codecs": 2}
    leaves = {m for m, imports in graph.items() if not imports}  # utilities every layer may use (rng, _validate)
    for module, imports in graph.items():
        layer = next((rank for prefix, rank in layers.items() if module.startswith(prefix)), None)
        if layer is None:
            continue
        for target in imports - leaves:
            target_layer = next((rank for prefix, rank in layers.items() if target.startswith(prefix)), 99)
            assert target_layer <= layer, f"{module} imports {target}, a layer above it"


def test_engine_imports_no_model_surgery_or_integrations():
    forbidden = ("lightning_act.nn", "lightning_act.integrations", "lightning_act.callbacks", "lightning_act.checkpoint",
                 "lightning_act.model_prep", "lightning_act.strategies")
    assert not [m for m in import_graph()["lightning_act.engine"] if m.startswith(forbidden)]


def test_the_graph_reader_sees_imports():
    graph = import_graph()
    assert "lightning_act.formats.quantize" in graph["lightning_act.codecs.quantize"]
    assert "lightning_act.engine" in graph["lightning_act.model_prep"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
