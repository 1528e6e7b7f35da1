"""Reference models built without torchvision or a hub download (torchvision does not import beside every
torch build): what the benchmarks, the tests and users comparing with published figures share."""
from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck: 1x1 -> 3x3 (stride) -> 1x1 (x4 channels), BN after each, ReLU after the sum."""

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out_channels = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.shortcut = nn.Identity() if stride == 1 and in_channels == out_channels else nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet50(num_classes: int = 1000) -> nn.Sequential:
    """ResNet-50 (He et al. 2016): stem, stages of 3/4/6/3 bottlenecks, average pool, linear head."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    channels = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(channels, width, stride if i == 0 else 1))
            channels = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)
