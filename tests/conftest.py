"""Fixtures shared by the test modules."""
import pytest

from tests.cuda_emulation.emulator import EmulatorRunner


@pytest.fixture(scope="module")
def runner() -> EmulatorRunner:
    """Runs the package's CUDA kernels on CPU threads (compiled once per source and content)."""
    return EmulatorRunner()


@pytest.fixture(autouse=True)
def no_tracker_wrappers_left():
    """Every test leaves torch's functions as it found them: the op tracker's wrappers are removed once the last
    tracker exits, even when a forward raised."""
    from lightning_act.optrack import _WRAPPERS

    yield
    assert _WRAPPERS.active == 0 and not _WRAPPERS.installed, "op tracker wrappers left installed"
