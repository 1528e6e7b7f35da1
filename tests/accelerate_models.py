"""The MLP and batches of the Accelerate tests (importable by the torchrun ranks test_accelerate.py spawns, which
must never import a test module)."""
import torch
from torch import nn


def mlp() -> nn.Sequential:
    """32 -> 512 -> 512 -> 4 with GELUs, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 4))


def random_batches(n: int = 4, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` seeded (inputs, labels) batches for ``mlp``."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 32, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]
