"""Weights that outlive engines: the tiers and the weight store kept between policies.

Knows: when a new engine can keep the resident weights as they are (same format and
placement), must move them layer by layer to a new placement (never two full copies: the
new engine's memory plan counts the old layers not yet moved), or must read them again
(compressed weights that should become exact ones, or a move that would not fit the
budgets); the memory already held that a new engine may count as free.
Does not know: checkpoints (it is handed a function that reads a layer), requests, policies'
search, when an engine should be replaced (the caller decides).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from tqdm import tqdm

from flexoff.errors import MemoryBudgetError
from flexoff.models.base import Family
from flexoff.models.spec import ModelSpec
from flexoff.offload.adapters import Need
from flexoff.offload.engine import Engine
from flexoff.offload.kvcache import KVCodec
from flexoff.offload.layout import WeightFormat
from flexoff.offload.pipeline import PipeLink
from flexoff.offload.tiers import Budgets, Tiers
from flexoff.offload.weights import WeightStore
from flexoff.policy.policy import Policy

ReadLayer = Callable[[int, torch.device], Mapping[str, torch.Tensor]]  # (layer, device) -> its tensors


class Residency:
    """The tiers and the weight store of one model, across the engines made for it."""

    def __init__(self, family: Family, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 offload_dir: str | None, budgets: Budgets, pipe: PipeLink | None = None):
        self.fam, self.spec, self.device, self.dtype = family, spec, device, dtype
        self.pipe = pipe  # the engines run one pipeline stage (spec: the stage's layers)
        self.offload_dir, self.budgets = offload_dir, budgets
        self.tiers: Tiers | None = None
        self.weights: WeightStore | None = None  # the store the current engine uses

    def engine(self, policy: Policy, fmt: WeightFormat, codec: KVCodec, max_prompt: int, max_gen: int,
               read: ReadLayer, read_device: torch.device, progress: bool = False, adapter_need: Need = Need(),
               adapter_host_bytes: int = 0, training: bool = False, windows: int | None = None) -> Engine:
        """A new engine for the policy, its weights kept, moved or read (through `read`, onto
        `read_device`, then placed)."""
        if self.tiers is None:
            self.tiers = Tiers(self.device, self.offload_dir)
        old = self.weights
        reuse = old is not None and old.matches(fmt, policy)
        if old is not None and not reuse:  # free before the new engine allocates: it counts them free
            if old.fmt.key != fmt.key and old.fmt.key[0] != "plain":
                old.release()  # compressed weights cannot become exact ones: read the checkpoint again
                self.weights = old = None
            else:
                old.release_slots()

        def build(old: WeightStore | None) -> Engine:
            return Engine(self.fam, self.spec, policy, device=self.device, dtype=self.dtype, max_prompt=max_prompt,
                          max_gen=max_gen, offload_dir=self.offload_dir, budgets=self.budgets, weight_format=fmt,
                          kv_codec=codec, tiers=self.tiers, weights=old if reuse else None,
                          credit=self._credit(old), moving=old.splits if old is not None and not reuse else None,
                          adapter_need=adapter_need, adapter_host_bytes=adapter_host_bytes, training=training,
                          pipe=self.pipe, windows=windows)
        try:
            engine = build(old)
        except MemoryBudgetError:
            if old is None or reuse:
                raise
            old.release()  # moving would hold both copies for a while: read the weights again instead
            self.weights = old = None
            engine = build(old)
        if not reuse:
            try:
                self._place(engine, old, read, read_device, progress)
            except BaseException:
                engine.close()
                self.close()
                raise
        self.tiers.cpu.trim()  # pinned buffers the new engine did not reuse go back to the system
        return engine

    def _credit(self, weights: WeightStore | None) -> dict[str, int]:
        """Memory already held that a new engine may count as free: the current weights (kept
        or moved) and pooled pinned buffers."""
        credit = dict(weights.mem.held()) if weights is not None else {"gpu": 0, "cpu": 0, "disk": 0}
        credit["cpu"] += self.tiers.cpu.pooled
        return credit

    def _place(self, engine: Engine, old: WeightStore | None, read: ReadLayer, read_device: torch.device,
               progress: bool) -> None:
        """Fill the new engine's store, which the residency keeps beyond it: from the old store
        layer by layer (each old layer given back as it moves), or read."""
        new = self.weights = engine.detach_weights()
        layers = tqdm(range(len(self.spec.layers)), unit="layer", leave=False, disable=not progress,
                      desc="loading weights" if old is None else "moving weights")
        if old is None:
            engine.load_weights((j, read(j, read_device)) for j in layers)
        else:
            same = old.fmt.key == new.fmt.key
            for j in layers:
                new.fill(j, old.take(j, encoded=same, device=self.device), encoded=same)
            old.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the loading temporaries' blocks go back for compute

    def close(self) -> None:
        """Give back the weights and the tiers (unpinning host memory, removing the offload folder)."""
        if self.weights is not None:
            self.weights.release()
            self.weights = None
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None

