"""The per-row LoRA kernel against its reference (on the CPU via TRITON_INTERPRET=1): adapters of
mixed ranks packed without padding, rows on the base model among them, prefill and decode
shapes, odd sizes and dtypes."""

from __future__ import annotations

import pytest
import torch

from flexoff.adapters.peft import Adapter, LoraModule
from flexoff.kernels import lora as L
from flexoff.offload.adapters import pack

pytestmark = pytest.mark.skipif(not L.HAVE_TRITON, reason="triton is not installed")


def adapters(ranks: list[int], fin: int, fout: int) -> list[Adapter]:
    out = []
    for i, r in enumerate(ranks):
        mods = {} if r == 0 else {(1, "w"): LoraModule(torch.randn(r, fin), torch.randn(fout, r), 0.5 + i)}
        out.append(Adapter(f"a{i}", "", mods))
    return out


@pytest.mark.parametrize("n,s,fin,fout,ranks,ids", [
    (5, 1, 37, 70, [3, 16, 0, 1], [0, -1, 1, 3, 0]),
    (3, 4, 64, 33, [8, 64], [1, 0, -1]),
    (2, 1, 130, 96, [256, 2], [0, 1]),
    (4, 2, 16, 16, [5], [-1, -1, 0, -1]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(n, s, fin, fout, ranks, ids, dtype):
    torch.manual_seed(n * 7 + fin)
    p = pack(adapters(ranks, fin, fout), (1, "w"), torch.device("cpu"), dtype)
    x = torch.randn(n, s, fin).to(dtype)
    y = torch.randn(n, s, fout).to(dtype)
    idx = torch.tensor(ids, dtype=torch.int32)
    want = L.lora_delta_ref(x, y.clone(), idx, p)
    got = L.lora_delta_triton(x, y.clone(), idx, p)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    base_rows = [r for r, a in enumerate(ids) if a < 0 or ranks[a] == 0]
    assert torch.equal(got[base_rows], y[base_rows])  # rows without LoRA untouched
