"""The adapter pool: LoRA adapters on the compute device, and their deltas added beside each
adapted projection for the rows of a batch that use them.

Knows: every loaded adapter's A and B, packed per (layer, matmul tensor) across adapters
(kernels.lora.LoraPack: no adapter padded to the largest rank) in the compute dtype; each
adapter's index; a batch's adapter per row as an index tensor (-1: the base model); weight
objects whose `linear` adds the rows' deltas to the base projection (so model files, which
call `linear`, never mention adapters).
Does not know: PEFT's files (flexoff.adapters), the schedule. All adapters sit on the compute
device; paging them per layer with the weights is still to come.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from flexoff.adapters.peft import Adapter
from flexoff.kernels.lora import LoraPack, lora_delta
from flexoff.models.base import linear, materialize


class LoraLinear:
    """A base weight (a tensor or a weight object) and the LoRA of its batch's rows."""

    def __init__(self, base: Any, ids: torch.Tensor, pack: LoraPack):
        self.base, self.ids, self.pack = base, ids, pack

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return lora_delta(x, linear(x, self.base, b), self.ids, self.pack)

    def dense(self) -> torch.Tensor:
        return materialize(self.base)


def pack(adapters: Sequence[Adapter], key: tuple[int, str], device: torch.device, dtype: torch.dtype) -> LoraPack:
    """One matmul's LoRA across adapters (rank 0 for those that leave it alone)."""
    mods = [a.modules.get(key) for a in adapters]
    ranks = [m.A.shape[0] if m is not None else 0 for m in mods]
    offsets = [sum(ranks[:i]) for i in range(len(ranks))]
    A = torch.cat([m.A for m in mods if m is not None]).to(device, dtype).contiguous()
    Bt = torch.cat([m.B.t() for m in mods if m is not None]).to(device, dtype).contiguous()
    scales = tuple(m.scaling if m is not None else 0.0 for m in mods)
    return LoraPack(A, Bt, torch.tensor(ranks, dtype=torch.int32, device=device),
                    torch.tensor(offsets, dtype=torch.int32, device=device),
                    torch.tensor(scales, dtype=torch.float32, device=device), tuple(ranks), max(ranks), scales)


class AdapterPool:
    def __init__(self, adapters: Sequence[Adapter], device: torch.device, dtype: torch.dtype):
        self.index = {a.name: i for i, a in enumerate(adapters)}
        keys = {key for a in adapters for key in a.modules}
        self.packs = {key: pack(adapters, key, device, dtype) for key in keys}
        self.device = device

    def ids(self, names: Sequence[str | None]) -> torch.Tensor:
        """A batch's adapter per row as indices on the device (-1: the base model)."""
        return torch.tensor([self.index[n] if n is not None else -1 for n in names], dtype=torch.int32,
                            device=self.device)

    def adapt(self, j: int, w: Mapping[str, Any], ids: torch.Tensor, present: frozenset[int]) -> Mapping[str, Any]:
        """Layer j's weights, its matmuls that an adapter of the batch (`present`) adapts wrapped."""
        out = None
        for name in w:
            p = self.packs.get((j, name))
            if p is not None and any(p.ranks[a] for a in present):
                out = out if out is not None else dict(w)
                out[name] = LoraLinear(w[name], ids, p)
        return out if out is not None else w
