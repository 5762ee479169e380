"""The group-wise format: round-trip error bounds, adversarial inputs, sizes."""

from __future__ import annotations

import pytest
import torch

from flexoff.quant import QuantConfig, QuantError, compressed_bytes, dequantize, quantize
from flexoff.quant.format import to_rows


def bound(x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Per-value error bound: half a step of the group's range, plus float16 rounding of its
    minimum and scale; returned in the grouped row layout."""
    g = to_rows(x.double(), cfg).reshape(-1, cfg.group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / cfg.levels
    return (step / 2 + lo.abs() / 2048 + cfg.levels * step / 2048 + 1e-6).expand_as(g)


@pytest.mark.parametrize("shape,cfg", [
    ((64, 64), QuantConfig()), ((100, 70), QuantConfig(dim=0)), ((3, 5, 128), QuantConfig(group=32)),
    ((17, 40), QuantConfig(bits=8, group=8)), ((9, 256), QuantConfig(group=128, dim=1)),
])
def test_round_trip_within_the_bound(shape, cfg):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 1
    y = dequantize(quantize(x, cfg))
    assert y.shape == x.shape and y.dtype == x.dtype
    err = to_rows((x - y).double().abs(), cfg).reshape(-1, cfg.group)
    assert (err <= bound(x, cfg)).all()
    if cfg.bits == 4:  # and the bound is close to tight: errors reach most of half a step
        assert err.max() > 0.3 * bound(x, cfg).max()


def test_adversarial_groups():
    cfg = QuantConfig(group=16)
    const = torch.full((4, 64), 3.14159)
    y = dequantize(quantize(const, cfg))
    assert torch.allclose(y, const, atol=3.15 / 2048)
    x = torch.randn(8, 64) * 0.01
    x[:, 5] = 1000.0  # an outlier spreads its own group only
    y = dequantize(quantize(x, cfg))
    err = (x - y).abs()
    assert (err[:, 16:] <= bound(x, cfg).reshape(8, 64)[:, 16:]).all() and err[:, 16:].max() < 3e-3
    assert (err[:, :16] <= 1000 / 30 + 1000 / 2048 + 1).all()
    for bad in (float("nan"), float("inf")):
        x[0, 0] = bad
        with pytest.raises(QuantError, match="NaN or infinite"):
            quantize(x, cfg)


def test_sizes_and_packing():
    cfg = QuantConfig(group=64, dim=0)
    x = torch.randn(130, 50)  # 130 output channels: padded to 192 in groups of 64
    c = quantize(x, cfg)
    assert c.data.shape == (50, 96) and c.scale.shape == (50, 3) and c.scale.dtype == torch.float16
    assert c.nbytes == compressed_bytes(x.shape, cfg)
    q = quantize(torch.tensor([[0.0, 15.0] * 32]), QuantConfig(group=64))
    assert q.data[0, 0].item() == 0xF0  # the even value in the low nibble
    with pytest.raises(QuantError):
        QuantConfig(bits=3)


@pytest.mark.parametrize("shape,piece", [((100, 37), 300), ((64, 5), 64), ((130, 9), 10**6)])
def test_quantizing_in_pieces_is_quantizing_whole(shape, piece):
    """A weight quantized a few columns at a time packs to exactly what the whole-matrix
    quantizer gives (groups run along the first dimension, so columns are independent)."""
    from flexoff.quant.format import quantize_in_pieces
    from flexoff.quant.sizes import weight_config

    cfg = weight_config(4, 64)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).half()
    whole, parts = quantize(x, cfg), quantize_in_pieces(x, cfg, piece)
    for f in ("data", "scale", "mn"):
        assert torch.equal(getattr(whole, f), getattr(parts, f)), f
    assert parts.shape == whole.shape


def test_kv_records_encode_in_chunks_as_in_one_piece(monkeypatch):
    """A prompt encoded a few tokens at a time (bounded temporaries) gives the same bytes, and
    decodes to fake-quantized keys and values (group-wise along the head dimension)."""
    from flexoff.quant import engine as E

    codec = E.QuantKV(4, 64, torch.float32, 4, 64)
    k, v = torch.randn(3, 4, 50, 64), torch.randn(3, 4, 50, 64)
    whole = codec.encode(k, v)
    monkeypatch.setattr(E, "ENCODE_CHUNK", 3 * 2 * 4 * 64 * 4 * 7)  # seven tokens a piece
    assert torch.equal(codec.encode(k, v), whole)
    k2, v2 = codec.read(whole.reshape(-1), 3, 50)
    cfg = QuantConfig(4, 64, dim=-1)
    assert torch.equal(k2, dequantize(quantize(k, cfg)).to(k2.dtype))
    assert torch.equal(v2, dequantize(quantize(v, cfg)).to(v2.dtype))
