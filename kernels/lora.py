"""LoRA deltas for the rows of a batch, grouped by adapter (S-LoRA's and Punica's segmented
shrink/expand), behind one dispatch.

Knows: adding scaling * (x[rows] @ A.T) @ B.T to y[rows] for each adapter's rows, adapters of
mixed ranks, without padding any to the largest rank. Only the torch reference exists so far:
a Triton kernel (one launch for every segment) is to sit beside it.
Does not know: where adapters come from, which rows have which adapter.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]  # rows (m,), A (r, in), B (out, r), scaling


def lora_delta_ref(x: torch.Tensor, y: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
    """y with each segment's delta added to its rows: x (n, ..., in), y (n, ..., out)."""
    for rows, A, B, scaling in segments:
        d = F.linear(F.linear(x.index_select(0, rows), A), B) * scaling
        y = y.index_add(0, rows, d.to(y.dtype))
    return y


def lora_delta(x: torch.Tensor, y: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
    """The dispatch: the reference on every device for now."""
    return lora_delta_ref(x, y, segments)
