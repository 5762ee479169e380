"""Compression as transforms the engine applies: a compressed weight format and KV codec.

Knows: how a layer's matmul weights are stored compressed (three fields per
weight: packed codes, scale, minimum) and rebuilt as QWeight objects whose
`linear` runs the fused kernel at decode shapes and dequantize-then-matmul
otherwise; how KV records are quantized when stored and dequantized for
attention; which format and codec a Policy asks for.
Does not know: placement or scheduling; model files never see any of this
(they call `linear`, which QWeight implements).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from flexoff.kernels.quant import dequantize_rows, kv_encode_ok, kv_encode_triton, qmatmul, quantize_rows
from flexoff.models.base import LayerSpec
from flexoff.models.spec import ModelSpec
from flexoff.offload.kvcache import PlainKV, records
from flexoff.offload.layout import PlainFormat
from flexoff.policy.policy import Policy
from flexoff.quant.format import QuantConfig, from_rows, part_shapes, quantize_in_pieces, to_rows
from flexoff.quant.sizes import compresses, kv_config, kv_record_bytes, weight_config

PARTS = ("data", "scale", "mn")
PART_DTYPES = {"data": torch.uint8, "scale": torch.float16, "mn": torch.float16}


class QWeight:
    """A compressed Linear weight (out, in), stored as `in` rows grouped along `out`."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, shape: tuple[int, int],
                 dtype: torch.dtype, cfg: QuantConfig):
        self.data, self.scale, self.mn, self.shape, self.dtype, self.cfg = data, scale, mn, shape, dtype, cfg

    def dense(self) -> torch.Tensor:
        rows = dequantize_rows(self.data, self.scale, self.mn, self.cfg, self.dtype)  # (in, out padded)
        return from_rows(rows, self.shape, self.cfg)

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = qmatmul(x.reshape(-1, x.shape[-1]), self.data, self.scale, self.mn, self.cfg, self.shape[0], b)
        return y.view(*lead, self.shape[0])


class CompressedFormat:
    """Matmul weights compressed group-wise along their output channels; the rest as is."""

    def __init__(self, dtype: torch.dtype, bits: int, group: int):
        self.dtype, self.cfg = dtype, weight_config(bits, group)
        self.key = ("compressed", dtype, bits, group)

    def fields(self, layer: LayerSpec) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        out = []
        for t in layer.tensors:
            if compresses(t):
                out += [(f"{t.name}:{p}", PART_DTYPES[p], shape) for p, shape in part_shapes(t.shape, self.cfg).items()]
            else:
                out.append((t.name, self.dtype, t.shape))
        return out

    def encode(self, layer: LayerSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for t in layer.tensors:
            x = tensors[t.name]
            if compresses(t):  # in pieces: a weight loaded onto a nearly full GPU has little room
                c = quantize_in_pieces(x, self.cfg)
                out.update({f"{t.name}:data": c.data, f"{t.name}:scale": c.scale, f"{t.name}:mn": c.mn})
            else:
                out[t.name] = x.to(self.dtype)
        return out

    def assemble(self, layer: LayerSpec, views: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for t in layer.tensors:
            if compresses(t):
                out[t.name] = QWeight(*(views[f"{t.name}:{p}"] for p in PARTS), t.shape, self.dtype, self.cfg)
            else:
                out[t.name] = views[t.name]
        return out


ENCODE_CHUNK = 128 << 20  # dense bytes of KV records quantized at a time (QuantKV.encode)


class QuantKV:
    """KV records quantized along the head dimension: (2, kv_heads) rows of codes, then their
    scales, then their minimums, all bytes of one token of one sequence."""

    lossy = True

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, bits: int, group: int):
        self.kvh, self.hd, self.dtype = kv_heads, head_dim, dtype
        self.cfg = kv_config(bits, group, head_dim)
        self.rec_bytes = kv_record_bytes(kv_heads, head_dim, dtype.itemsize, self.cfg)
        shapes = part_shapes((head_dim,), self.cfg)
        self.sizes = {p: 2 * kv_heads * shapes[p][1] * PART_DTYPES[p].itemsize for p in PARTS}

    def encode(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Records of k, v (rows, kv_heads, s, head_dim) as contiguous (s, rows, rec) bytes, into
        `out` where given. On CUDA one kernel quantizes them in place (kv_encode_triton); else
        ENCODE_CHUNK dense bytes at a time: a prompt's full-precision records (704 MB for 48
        OPT-30B rows of 512 tokens) never exist at once."""
        rows, s = k.shape[0], k.shape[2]
        if out is None:
            out = torch.empty(s, rows, self.rec_bytes, dtype=torch.uint8, device=k.device)
        if kv_encode_ok(k, self.cfg):
            kv_encode_triton(k, v, out, self.cfg)
            return out
        step = max(1, ENCODE_CHUNK // (rows * 2 * self.kvh * self.hd * k.element_size()))
        for t0 in range(0, s, step):  # a token range of the records is one contiguous run
            torch.cat(self._encoded(k[:, :, t0:t0 + step], v[:, :, t0:t0 + step]), dim=-1,
                      out=out[t0:t0 + step])
        return out

    def _encoded(self, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        """The codes, scales and minimums of k, v's records, each (s, rows, bytes)."""
        x = records(k, v)  # (s, rows, 2, kvh, d), contiguous
        s, rows = x.shape[:2]
        parts = quantize_rows(to_rows(x, self.cfg), self.cfg)  # rows of (s * rows * 2 * kvh)
        return [p.reshape(s, rows, -1).view(torch.uint8) for p in parts]

    def write(self, buf: torch.Tensor, rows: int, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
        s, rec = k.shape[2], self.rec_bytes
        self.encode(k, v, out=buf[t * rows * rec:(t + s) * rows * rec].view(s, rows, rec))

    def read(self, buf: torch.Tensor, rows: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of tokens 0 .. t: (rows, kv_heads, t, head_dim) each."""
        recs = buf[:t * rows * self.rec_bytes].view(t, rows, self.rec_bytes)
        parts, off = [], 0
        for p in PARTS:
            raw = recs[:, :, off:off + self.sizes[p]]
            off += self.sizes[p]
            parts.append(raw.reshape(t * rows * 2 * self.kvh, -1).view(PART_DTYPES[p]))
        x = dequantize_rows(*parts, self.cfg, self.dtype)[:, :self.hd].view(t, rows, 2, self.kvh, self.hd)
        return x[:, :, 0].permute(1, 2, 0, 3), x[:, :, 1].permute(1, 2, 0, 3)


def formats(policy: Policy, spec: ModelSpec, dtype: torch.dtype) -> tuple[Any, Any]:
    """The weight format and KV codec a policy asks for."""
    fmt = CompressedFormat(dtype, policy.quant_bits, policy.quant_group) if policy.compress_weight \
        else PlainFormat(dtype)
    codec = QuantKV(spec.num_kv_heads, spec.head_dim, dtype, policy.quant_bits, policy.quant_group) \
        if policy.compress_cache else PlainKV(spec.num_kv_heads, spec.head_dim, dtype)
    return fmt, codec
