"""Inputs the lorenzo tests share: adversarial values around the grid and a hypothesis strategy of tensors."""
import numpy as np
import torch
from hypothesis import strategies as st

from lightning_act.formats.lorenzo import working_bound

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def adversarial_values(error_bound: float, dtype: torch.dtype, count: int, seed: int) -> torch.Tensor:
    """Grid points k * step and midpoints, +-1 ulp, the bound itself, denormals, huge values, -0.0, NaN/Inf."""
    eb, step, _ = working_bound(error_bound)
    gen = np.random.default_rng(seed)
    k = gen.integers(-1000, 1000, count).astype(np.float32)
    grid = np.concatenate([k * np.float32(step), (k + np.float32(0.5)) * np.float32(step)]).astype(np.float32)
    grid = np.concatenate([grid, np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(-np.inf))])
    special = np.array([eb, -eb, np.nextafter(np.float32(eb), np.float32(1)), 1e-45, -1e-45, 1.2e-38, 0.0, -0.0,
                        3.0e38, -3.0e38, 65504.0, 1e20, np.nan, np.inf, -np.inf], dtype=np.float32)
    values = torch.from_numpy(np.concatenate([grid, special]))
    return values[torch.from_numpy(gen.permutation(values.numel()))].to(dtype)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    error_bound = 10 ** draw(st.floats(-6, -1))
    numel = draw(st.integers(0, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "relu", "smooth", "constant", "adversarial", "mixed"]))
    scale = 10 ** draw(st.floats(-7, 4))
    base = torch.float64 if dtype == torch.float64 else torch.float32  # float64 values off the float32 grid
    if kind == "normal":
        x = torch.randn(numel, generator=gen, dtype=base) * scale
    elif kind == "relu":
        x = torch.relu(torch.randn(numel, generator=gen, dtype=base)) * scale
    elif kind == "smooth":
        x = torch.cumsum(torch.randn(numel, generator=gen, dtype=base) * error_bound, 0) * scale
    elif kind == "constant":
        x = torch.full((numel,), draw(st.floats(-1e6, 1e6)), dtype=base)
    elif kind == "adversarial":
        x = adversarial_values(error_bound, torch.float32, numel // 4 + 1, seed)[:numel].to(base)
    else:
        x = torch.randn(numel, generator=gen, dtype=base) * scale
        special = adversarial_values(error_bound, torch.float32, 4, seed).to(base)
        positions = torch.randint(0, max(numel, 1), (special.numel(),), generator=gen)
        if numel:
            x[positions] = special
    return x.to(dtype), error_bound
