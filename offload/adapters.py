"""The adapter pool: LoRA adapters on the compute device, and their deltas added beside each
adapted projection for the rows of a batch that use them.

Knows: every loaded adapter's A and B per (layer, matmul tensor) in the compute dtype, an
index per adapter name, the rows of each GPU batch that use each adapter (one segment per
adapter present), and weight objects whose `linear` adds those segments' deltas to the base
projection (so model files, which call `linear`, never mention adapters).
Does not know: PEFT's files (flexoff.adapters), the schedule. All adapters sit on the compute
device; paging them per layer with the weights is still to come.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from flexoff.adapters.peft import Adapter
from flexoff.kernels.lora import Segment, lora_delta
from flexoff.models.base import linear, materialize


class LoraLinear:
    """A base weight (a tensor or a weight object) and the LoRA segments of its batch's rows."""

    def __init__(self, base: Any, segments: Sequence[Segment]):
        self.base, self.segments = base, segments

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return lora_delta(x, linear(x, self.base, b), self.segments)

    def dense(self) -> torch.Tensor:
        return materialize(self.base)


class AdapterPool:
    def __init__(self, adapters: Sequence[Adapter], device: torch.device, dtype: torch.dtype):
        self.index = {a.name: i for i, a in enumerate(adapters)}
        self.modules: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        for i, a in enumerate(adapters):
            for key, m in a.modules.items():
                self.modules.setdefault(key, {})[i] = (m.A.to(device, dtype), m.B.to(device, dtype), m.scaling)
        self.device = device

    def rows(self, names: Sequence[str | None]) -> dict[int, torch.Tensor]:
        """Each adapter's rows in a batch whose rows use these adapters (None: the base model)."""
        out: dict[int, list[int]] = {}
        for r, name in enumerate(names):
            if name is not None:
                out.setdefault(self.index[name], []).append(r)
        return {i: torch.tensor(rs, device=self.device) for i, rs in out.items()}

    def adapt(self, j: int, w: Mapping[str, Any], rows: Mapping[int, torch.Tensor]) -> Mapping[str, Any]:
        """Layer j's weights with LoRA segments on the matmuls that the batch's adapters adapt."""
        if not rows:
            return w
        out = dict(w)
        for name in w:
            per = self.modules.get((j, name))
            if not per:
                continue
            segs = [(rows[i], *per[i]) for i in rows if i in per]
            if segs:
                out[name] = LoraLinear(w[name], segs)
        return out
