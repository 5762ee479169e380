"""Asymmetric group-wise quantization: the format and its plain torch reference.

Knows: how a tensor is grouped (g consecutive values along one dimension),
quantized to `bits` per value with a per-group scale and minimum (float16),
packed two 4-bit values per byte, and restored; how many bytes that takes.
The grouped dimension is moved last, so a compressed tensor is rows of
groups: data (rows, n * bits / 8) uint8, scale and minimum (rows, n / g)
float16, where n is the grouped length padded up to a multiple of g.
Weights are grouped along the output-channel dimension (dim 0 of a Linear
weight, as FlexGen does), the KV cache along the head dimension.
Does not know: where tensors live, kernels (flexoff.kernels has the fast
paths and checks them against this reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexoff.errors import FlexoffError


class QuantError(FlexoffError):
    """A tensor that cannot be quantized (NaN or infinite values, bad settings)."""


@dataclass(frozen=True)
class QuantConfig:
    bits: int = 4  # 4 or 8
    group: int = 64  # values per group
    dim: int = -1  # the grouped dimension

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise QuantError(f"bits must be 4 or 8, got {self.bits}")
        if self.group < 2 or self.group % 2:
            raise QuantError(f"group must be an even number >= 2, got {self.group}")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1


@dataclass
class Compressed:
    """A quantized tensor: packed values, per-group scale and minimum, and what it was."""

    data: torch.Tensor  # (rows, n_pad * bits / 8) uint8
    scale: torch.Tensor  # (rows, n_pad / group) float16
    mn: torch.Tensor  # (rows, n_pad / group) float16
    shape: tuple[int, ...]  # original shape
    dtype: torch.dtype  # original dtype
    cfg: QuantConfig

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.mn))


def padded(n: int, group: int) -> int:
    return -(-n // group) * group


def grouped_shape(shape: tuple[int, ...], cfg: QuantConfig) -> tuple[int, int]:
    """(rows, padded grouped length) of a tensor of this shape."""
    dim = cfg.dim % len(shape)
    n = shape[dim]
    return math.prod(shape) // n, padded(n, cfg.group)


def part_shapes(shape: tuple[int, ...], cfg: QuantConfig) -> dict[str, tuple[int, int]]:
    rows, n = grouped_shape(shape, cfg)
    return {"data": (rows, n * cfg.bits // 8), "scale": (rows, n // cfg.group), "mn": (rows, n // cfg.group)}


def compressed_bytes(shape: tuple[int, ...], cfg: QuantConfig) -> int:
    p = part_shapes(shape, cfg)
    return math.prod(p["data"]) + 2 * 2 * math.prod(p["scale"])


def to_rows(x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Move the grouped dimension last and pad it (repeating its last value) to whole groups."""
    x = x.movedim(cfg.dim % x.dim(), -1).reshape(-1, x.shape[cfg.dim % x.dim()])
    n = x.shape[-1]
    if n % cfg.group:
        x = torch.cat([x, x[:, -1:].expand(-1, padded(n, cfg.group) - n)], dim=-1)
    return x


def from_rows(rows: torch.Tensor, shape: tuple[int, ...], cfg: QuantConfig) -> torch.Tensor:
    """Inverse of to_rows: trim the padding and move the grouped dimension back."""
    dim = cfg.dim % len(shape)
    moved = shape[:dim] + shape[dim + 1:] + (shape[dim],)
    return rows[:, :shape[dim]].reshape(moved).movedim(-1, dim)


def grid(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 scale and minimum of each group: (hi - lo) / levels and lo, rounded to nearest."""
    return ((hi - lo) / levels).to(torch.float16), lo.to(torch.float16)


def quantize(x: torch.Tensor, cfg: QuantConfig = QuantConfig()) -> Compressed:
    """The reference quantizer. Values are rounded to the group's float16 grid, so the error per
    value is at most half a step, (max - min) / 30 for 4 bits, plus the float16 rounding of the
    group's minimum and scale (at most |min| / 2048 + levels * scale / 2048)."""
    if not torch.isfinite(x).all():
        raise QuantError("cannot quantize a tensor with NaN or infinite values")
    rows = to_rows(x.float(), cfg)
    data, scale, mn = quantize_rows(rows, cfg)
    return Compressed(data, scale, mn, tuple(x.shape), x.dtype, cfg)


def quantize_in_pieces(x: torch.Tensor, cfg: QuantConfig, piece: int = 1 << 24) -> Compressed:
    """quantize(x) of a matrix grouped along its first dimension, a few columns at a time (each
    column is a row of the packed form): the same result, with float32 temporaries of about
    `piece` values instead of the whole matrix."""
    if x.dim() != 2 or cfg.dim % 2 != 0 or x.numel() <= piece:
        return quantize(x, cfg)
    cols = max(1, piece // x.shape[0])
    parts = [quantize(x[:, c:c + cols], cfg) for c in range(0, x.shape[1], cols)]
    return Compressed(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.mn for p in parts]), tuple(x.shape), x.dtype, cfg)


def quantize_rows(rows: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed data, scale and minimum of (rows, n) values, n a multiple of the group."""
    g = rows.float().view(rows.shape[0], -1, cfg.group)  # (rows, groups, group)
    scale, mn = grid(g.amin(-1), g.amax(-1), cfg.levels)
    step = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = ((g - mn.float()[..., None]) / step[..., None]).round().clamp(0, cfg.levels).to(torch.uint8)
    q = q.view(rows.shape[0], -1)
    if cfg.bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # two values per byte, even index in the low nibble
    return q.contiguous(), scale, mn


def unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return data
    return torch.stack((data & 0xF, data >> 4), dim=-1).view(data.shape[0], -1)


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, cfg: QuantConfig,
                    dtype: torch.dtype) -> torch.Tensor:
    """(rows, n) values from packed rows, computed in float32, returned in dtype."""
    q = unpack(data, cfg.bits).float().view(data.shape[0], -1, cfg.group)
    x = q * scale.float()[..., None] + mn.float()[..., None]
    return x.view(data.shape[0], -1).to(dtype)


def dequantize(c: Compressed) -> torch.Tensor:
    """The reference dequantizer."""
    return from_rows(dequantize_rows(c.data, c.scale, c.mn, c.cfg, c.dtype), c.shape, c.cfg)
