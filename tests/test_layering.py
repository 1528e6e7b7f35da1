"""Layering (issue #21): adaptation and metrics are framework neutral; only the Lightning adapters (callbacks,
strategies) import Lightning or ``lightning_act.callbacks``.

``import lightning_act`` itself loads the strategies (Lightning), so the checks read each module's own imports
with ``ast`` instead of watching ``sys.modules``."""
import ast
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


def _imported_modules(source: str, package: tuple[str, ...]) -> list[str]:
    """Absolute names of the modules (and ``from`` names) ``source`` imports, relative imports resolved against
    ``package``."""
    names = []
    for node in ast.walk(ast.parse(source)):
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
