"""Flat byte layouts of a layer's weights, and the plain weight format.

Knows: how the stored fields of one layer sit in one flat byte buffer (offsets,
alignment) and how to view them as typed tensors from the byte segments they
live in. Because a layer is one flat buffer, placement can split it by bytes
exactly ("20% on the GPU" means 20% of the bytes).
A weight format maps a layer's logical tensors to stored fields and back;
PlainFormat stores each tensor as is, in the compute dtype (quant/ provides a
compressed format with the same three methods).
Does not know: tiers, copies, models' math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import torch

from flexoff.models.base import LayerSpec

ALIGN = 64


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class Layout:
    """Fields of one layer packed in order into a flat buffer."""

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]):
        out, off = [], 0
        for name, dtype, shape in fields:
            off = -(-off // ALIGN) * ALIGN
            f = Field(name, dtype, tuple(shape), off)
            out.append(f)
            off = f.end
        self.fields: tuple[Field, ...] = tuple(out)
        self.nbytes = off

    def first_field_ending_after(self, pos: int) -> int:
        """Offset of the first field not wholly inside [0, pos): where staging must start."""
        for f in self.fields:
            if f.end > pos:
                return f.offset
        return self.nbytes

    def views(self, segments: Sequence[tuple[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Typed views of every field; segments are (start offset, uint8 buffer) pairs, the
        later ones taking precedence; each field must lie wholly inside one segment."""
        out = {}
        for f in self.fields:
            for start, buf in reversed(segments):
                if start <= f.offset and f.end <= start + buf.numel():
                    raw = buf[f.offset - start:f.end - start]
                    out[f.name] = raw.view(f.dtype).view(f.shape)
                    break
            else:
                raise AssertionError(f"field {f.name} is in no segment")
        return out

    def pack(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        """Write the fields' bytes into the uint8 buffer out (nbytes long)."""
        for f in self.fields:
            t = tensors[f.name]
            assert tuple(t.shape) == f.shape and t.dtype == f.dtype, (f, t.shape, t.dtype)
            out[f.offset:f.end].copy_(t.contiguous().reshape(-1).view(torch.uint8))


class WeightFormat(Protocol):
    """How a layer's logical weights are stored, and rebuilt for compute."""

    key: tuple  # equal keys store identical bytes

    def fields(self, layer: LayerSpec) -> list[tuple[str, torch.dtype, tuple[int, ...]]]: ...
    def encode(self, layer: LayerSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def assemble(self, layer: LayerSpec, views: Mapping[str, torch.Tensor]) -> dict[str, Any]: ...


class PlainFormat:
    """Every tensor stored as is, in the compute dtype."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.key = ("plain", dtype)

    def fields(self, layer: LayerSpec) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(t.name, self.dtype, t.shape) for t in layer.tensors]

    def encode(self, layer: LayerSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {t.name: tensors[t.name].to(self.dtype) for t in layer.tensors}

    def assemble(self, layer: LayerSpec, views: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return dict(views)
