"""Small LightningModules, loaders and Trainer settings shared by the Lightning tests (importable by spawned DDP
workers, which must never import a test module)."""
import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch import nn

# a quiet single-epoch CPU run: no logger, checkpoints, progress bar or model summary
TRAINER_ARGS = dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)


class TinyCNN(L.LightningModule):
    """A conv net on random 3x16x16 images; ``compressed_ratios`` records the compressor's ratio per step."""

    def __init__(self, manual: bool = False):
        super().__init__()
        self.automatic_optimization = not manual
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))
        self.compressed_ratios: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        compressor = getattr(self.trainer.strategy, "compressor", None)
        if compressor is not None:
            self.compressed_ratios.append(compressor.stats().ratio)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def random_loader(n: int = 64, batch_size: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)`` in ``metrics``, for tests to compare."""

    name, version = "memory", 0

    def __init__(self):
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass
