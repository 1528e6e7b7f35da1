"""Layering (issue #21): adaptation and metrics are framework neutral; only the Lightning adapters (callbacks,
strategies) import Lightning or ``lightning_act.callbacks``. Tests, recipes and benchmarks reach shared code
through the package and helper modules: no test imports a test module, and none of them edits ``sys.path``.

``import lightning_act`` itself loads the strategies (Lightning), so the checks read each module's own imports
with ``ast`` instead of watching ``sys.modules``."""
import ast
import contextlib
import re
import textwrap
from pathlib import Path

import pytest

import lightning_act as act
import lightning_act.adapt
import lightning_act.metrics
from lightning_act.callbacks import monitor

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_act"
NEUTRAL = sorted((PACKAGE / "adapt").glob("*.py")) + [PACKAGE / "metrics.py"]
CLIENTS = sorted([*(PACKAGE / "integrations").glob("*.py"), *(ROOT / "recipes").glob("*.py"),
                  *(ROOT / "benchmarks").glob("*.py")])
TESTS = ROOT / "tests"
TEST_MODULES = {path.stem for path in TESTS.rglob("test_*.py")}
# every Python file of tests/, recipes/ and benchmarks/ except this one, whose examples of edits are meant to be caught
SCRIPTS = sorted(p for folder in (TESTS, ROOT / "recipes", ROOT / "benchmarks") for p in folder.rglob("*.py")
                 if p != Path(__file__).resolve())
# a str.format field such as {root!r}; doubled braces are literal ones
FORMAT_FIELD = re.compile(r"(?<!\{)\{[^{}]*\}(?!\})")


def _embedded_code(tree: ast.AST) -> list[ast.AST]:
    """The code in ``tree``'s string literals: the scripts tests write for subprocesses (``python -c``, DDP and
    torchrun workers). Format fields become a name; a string that does not parse as a whole is read line by line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "_" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = FORMAT_FIELD.sub("_", node.value).replace("{{", "{").replace("}}", "}")
        else:
            continue
        try:
            found.append(ast.parse(textwrap.dedent(text)))
        except SyntaxError:  # a fragment of an f-string, or a script whose fields were not plain names
            for line in text.splitlines():
                with contextlib.suppress(SyntaxError):
                    found.append(ast.parse(line.strip()))
    return found


def _trees(path: Path) -> list[ast.AST]:
    tree = ast.parse(path.read_text())
    return [tree, *_embedded_code(tree)]


def _imported_modules(source: str | ast.AST, package: tuple[str, ...]) -> list[str]:
    """Absolute names of the modules (and ``from`` names) ``source`` imports, relative imports resolved against
    ``package``."""
    names = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def _offending(paths, forbidden) -> dict[str, list[str]]:
    found = {}
    for path in paths:
        package = path.relative_to(ROOT).with_suffix("").parts[:-1]
        bad = [n for n in _imported_modules(path.read_text(), package) if any(n == f or n.startswith(f + ".") for f in forbidden)]
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_checked_files_exist():
    assert PACKAGE / "adapt" / "auto_precision.py" in NEUTRAL and len(NEUTRAL) >= 5
    assert PACKAGE / "integrations" / "transformers.py" in CLIENTS and ROOT / "recipes" / "demo_digits.py" in CLIENTS


def test_adapt_and_metrics_import_no_lightning_and_no_callbacks():
    assert _offending(NEUTRAL, ("lightning", "pytorch_lightning", "lightning_act.callbacks",
                                "lightning_act.strategies")) == {}


def test_integrations_recipes_and_benchmarks_do_not_import_callbacks():
    assert _offending(CLIENTS, ("lightning_act.callbacks",)) == {}


@pytest.mark.parametrize("source", ["from ..callbacks.auto_precision import AutoPrecision",
                                    "from .. import callbacks", "import lightning_act.callbacks.monitor",
                                    "from lightning_act.callbacks import AutoPrecision"])
def test_the_check_sees_relative_and_absolute_imports(source):
    names = _imported_modules(source, ("lightning_act", "integrations"))
    assert any(n.startswith("lightning_act.callbacks") for n in names)
    assert not any(n.startswith("lightning_act.callbacks")
                   for n in _imported_modules("from ..adapt import AutoPrecision", ("lightning_act", "integrations")))


@pytest.mark.parametrize("name", ["step_metrics", "tensor_histograms"])
def test_monitor_reexports_the_metrics(name):
    assert getattr(monitor, name) is getattr(lightning_act.metrics, name)


def test_lightning_callback_is_the_neutral_controller_with_hooks():
    assert issubclass(act.callbacks.AutoPrecision, lightning_act.adapt.AutoPrecision)
    assert lightning_act.adapt.AutoPrecision.__module__ == "lightning_act.adapt.auto_precision"
    assert not hasattr(lightning_act.adapt.AutoPrecision, "on_train_batch_start")


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _sys_path_edits(tree: ast.AST) -> list[str]:
    """The statements of ``tree`` that change ``sys.path``: its mutating methods, assignments to it or to a slice
    of it, and ``from sys import path`` (edits through the bare name would escape the other checks)."""
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value):
            if node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear"):
                edits.append(ast.unparse(node))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(_is_sys_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets):
                edits.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            edits.append(ast.unparse(node))
    return edits


def test_no_test_module_imports_another_test_module():
    assert len(TEST_MODULES) > 20 and "test_lightning" in TEST_MODULES
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        package = path.relative_to(ROOT).with_suffix("").parts[:-1]
        names = {n for tree in _trees(path) for n in _imported_modules(tree, package)}
        bad = sorted(n for n in names if n.split(".")[0] in TEST_MODULES
                     or n.startswith("tests.") and n.split(".")[1] in TEST_MODULES)
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert found == {}


def test_tests_recipes_and_benchmarks_do_not_edit_sys_path():
    assert ROOT / "tests" / "conftest.py" in SCRIPTS and ROOT / "benchmarks" / "run_all.py" in SCRIPTS
    found = {}
    for path in SCRIPTS:
        edits = [edit for tree in _trees(path) for edit in _sys_path_edits(tree)]
        if edits:
            found[str(path.relative_to(ROOT))] = edits
    assert found == {}


@pytest.mark.parametrize("source", [
    "sys.path.insert(0, 'x')", "sys.path.append(p)", "sys.path.extend([p])", "sys.path = [p, *sys.path]",
    "sys.path[:0] = [p]", "sys.path += [p]", "from sys import path",
    'script = f"""\nimport json, sys\nsys.path.insert(0, {root!r})\n"""',
    'SCRIPT = """\nimport sys\nsys.path.append({root!r})\nprint({{1: 2}})\n"""',
    'run(["python", "-c", "import sys; sys.path.insert(0, \'.\')"])',
])
def test_the_sys_path_check_sees_edits_also_in_subprocess_scripts(source):
    assert [e for tree in [ast.parse(source), *_embedded_code(ast.parse(source))] for e in _sys_path_edits(tree)]


def test_the_checks_leave_reads_of_sys_path_and_helper_imports_alone():
    source = 'print(sys.path[0], list(sys.path))\nSCRIPT = "from tests.lightning_models import TinyCNN"'
    trees = [ast.parse(source), *_embedded_code(ast.parse(source))]
    assert [e for tree in trees for e in _sys_path_edits(tree)] == []
    assert "tests.lightning_models.TinyCNN" in {n for tree in trees for n in _imported_modules(tree, ("tests",))}
    embedded = _embedded_code(ast.parse('S = f"""\nfrom tests.test_accelerate import _mlp\n{x}\n"""'))
    assert "tests.test_accelerate" in {n for tree in embedded for n in _imported_modules(tree, ("tests",))}
