"""CI's lowest-versions leg tests pyproject's lower bounds: each library pinned in ``.ci/lowest.txt`` is declared
with exactly that floor wherever pyproject names it."""
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _floors() -> dict[str, set[Version]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    floors: dict[str, set[Version]] = {}
    for requirement in map(Requirement, requirements):
        for spec in requirement.specifier:
            if spec.operator == ">=":
                floors.setdefault(canonicalize_name(requirement.name), set()).add(Version(spec.version))
    return floors


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
        if line.split("#")[0].strip():
            requirement = Requirement(line.split("#")[0])
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line!r}: the lowest leg pins with =="
            pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def test_lowest_pins_are_the_declared_floors():
    pins, floors = _pins(), _floors()
    assert {"lightning", "transformers", "accelerate", "torch-geometric"} <= pins.keys()
    for name, pin in pins.items():
        assert floors.get(name, {pin}) == {pin}, f"{name}: pyproject's floors {floors[name]}, .ci/lowest.txt {pin}"
