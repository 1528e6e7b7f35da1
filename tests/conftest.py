"""Fixtures shared by the test modules."""
import pytest

from tests.cuda_emulation.emulator import EmulatorRunner


@pytest.fixture(scope="module")
def runner() -> EmulatorRunner:
    """Runs the package's CUDA kernels on CPU threads (compiled once per source and content)."""
    return EmulatorRunner()
