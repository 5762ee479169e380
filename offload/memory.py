"""The engine's memory accounting: what a policy needs on each tier, checked
against budgets before anything is allocated.

Knows: the bytes the weight store, KV store and hidden store will allocate
(from the same sizing functions they use), the pinned buffers of the copy
engine, and an estimate of transient GPU working memory. Its totals are what
`flexoff policy` re-checks a searched policy against.
Does not know: how the memory is used.
"""

from __future__ import annotations

import shutil
import tempfile
import traceback
from pathlib import Path
from dataclasses import dataclass, field

import psutil
import torch

from flexoff.errors import MemoryBudgetError
from flexoff.models.spec import ModelSpec
from flexoff.offload.activations import act_bytes, backward_bytes, graph_bytes, keeps_graphs, stash_bytes
from flexoff.offload.kvcache import cached_batches, kv_bytes
from flexoff.offload.layout import Layout
from flexoff.offload.mover import CHUNK
from flexoff.offload.pipeline import link_bytes
from flexoff.offload.placement import TIERS
from flexoff.offload.tiers import GiB, Budgets
from flexoff.offload.weights import plan_weights, weight_bytes
from flexoff.policy.policy import GPU_RESERVE, Policy, weight_slots
from flexoff.policy.train_cost import optimizer_bytes

HOST_IO_SETS = 2  # CPU attention's pinned buffer sets: one call's copies overlap the last's attention


@dataclass
class MemoryPlan:
    parts: dict[str, dict[str, int]] = field(default_factory=dict)  # what -> tier -> bytes

    def add(self, what: str, per_tier: dict[str, int]) -> None:
        self.parts[what] = {t: int(per_tier.get(t, 0)) for t in TIERS}

    def total(self, tier: str) -> int:
        return sum(p[tier] for p in self.parts.values())

    def totals(self) -> dict[str, int]:
        return {t: self.total(t) for t in TIERS}

    def describe(self, tier: str) -> str:
        items = [f"{w} {p[tier] / GiB:.2f}" for w, p in self.parts.items() if p[tier]]
        return ", ".join(items) + " GiB"


def plan_memory(spec: ModelSpec, layouts: list[Layout], kv_rec_bytes: int, policy: Policy,
                max_prompt: int, max_gen: int, dtype: torch.dtype, cuda: bool, training: bool = False,
                adapters: dict[str, int] | None = None, trained: int = 0, windows: int | None = None) -> MemoryPlan:
    """What each tier holds for a policy; with `training`, windows of up to max_prompt tokens
    also stash every layer's input for the reverse sweep, and the optimizer holds its copies of
    the `trained` LoRA parameters (`windows`: GPU batches of a block that train, if not all: a
    co-serving block's, whose kept graphs or stash are planned for them only and the KV cache for
    the others); `adapters`: LoRA adapter bytes per tier."""
    elem = dtype.itemsize
    plan = MemoryPlan()
    plan.add("weights", weight_bytes(plan_weights(layouts, policy), weight_slots(policy.cpu_cache_compute)))
    plan.add("kv cache", kv_bytes(spec, kv_rec_bytes, policy, max_prompt + max_gen, cached_batches(policy, windows)))
    plan.add("activations", act_bytes(spec, elem, policy, max_prompt))
    if training:
        splits = plan_weights(layouts, policy)
        share = policy if windows is None else policy.replace(num_gpu_batches=min(windows, policy.num_gpu_batches))
        if keeps_graphs(all(s.resident for s in splits), policy):  # made by the windows of a block only
            plan.add("kept graphs", {"gpu": graph_bytes(spec, elem, share, max_prompt)})
        else:  # homes for the windows of a block
            plan.add("stash", stash_bytes(spec, elem, share, max_prompt))
        plan.add("backward working", {"gpu": backward_bytes(spec, elem, policy, max_prompt)})
        if trained:
            plan.add("optimizer", {"gpu": optimizer_bytes(trained, elem)})
    if adapters and any(adapters.values()):
        plan.add("adapters", adapters)
    pinned = 4 * CHUNK if (cuda and plan.total("disk") > 0) else 0  # disk bounce buffers
    if policy.cpu_cache_compute and cuda:
        # CPU attention's sets of q, k, v and output buffers (offload.host_io.HostIO)
        per_set = 2 * (spec.num_heads + spec.num_kv_heads) * spec.head_dim * policy.gpu_batch_size * elem
        pinned += HOST_IO_SETS * per_set
    plan.add("buffers", {"cpu": pinned})
    device = "cuda" if cuda else "cpu"
    working = spec.working_bytes(policy.gpu_batch_size, max_prompt, elem, device) + (GPU_RESERVE if cuda else 0)
    if policy.compress_weight:  # a weight dequantized for a matmul, or a layer's (autograd; shared by batches)
        working += spec.dequantized_bytes(elem, training or policy.num_gpu_batches > 1)
    working += spec.inflight_bytes(policy.gpu_batch_size, max_prompt, elem)
    plan.add("working", {"gpu": working})
    sends = link_bytes(spec, policy.gpu_batch_size, max_prompt, elem)  # a pipeline stage's
    if sends:
        plan.add("pipeline transfers", {"gpu": sends})
    return plan


def available(device: torch.device, offload_dir: str | None) -> dict[str, int]:
    """What the machine has for each tier now."""
    host = psutil.virtual_memory().available
    gpu = host
    if device.type == "cuda":  # the device's free memory and the blocks this process's allocator holds unused
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        gpu = torch.cuda.mem_get_info(device)[0] + unused
    where = Path(offload_dir or tempfile.gettempdir()).absolute()
    while not where.exists():  # the folder is created later; ask its nearest existing parent
        where = where.parent
    disk = shutil.disk_usage(where).free
    return {"gpu": gpu, "cpu": host, "disk": disk}


def check(plan: MemoryPlan, budgets: Budgets, device: torch.device, offload_dir: str | None,
          credit: dict[str, int] | None = None) -> None:
    """Raise MemoryBudgetError if the plan does not fit, naming need and budget. `credit`: bytes
    already allocated that the plan counts (weights kept from an earlier engine)."""
    have = available(device, offload_dir)
    for t, n in (credit or {}).items():
        have[t] += n
    if device.type == "cpu":
        have["cpu"] += (credit or {}).get("gpu", 0)
    limits = {t: getattr(budgets, t) if getattr(budgets, t) is not None else have[t] for t in TIERS}
    for tier in TIERS:
        need = plan.total(tier)
        if need > limits[tier]:
            flag = {"gpu": "--gpu-mem", "cpu": "--cpu-mem", "disk": "--disk-mem"}[tier]
            raise MemoryBudgetError(
                f"policy needs {need / GiB:.2f} GiB on {tier} ({plan.describe(tier)}) but "
                f"{limits[tier] / GiB:.2f} GiB is available ({flag}); move more to a lower tier, "
                f"use a smaller batch, or try --policy auto")
    if device.type == "cpu":  # the compute device is host memory too
        need = plan.total("gpu") + plan.total("cpu")
        if need > have["cpu"]:
            raise MemoryBudgetError(
                f"policy needs {need / GiB:.2f} GiB of host memory but {have['cpu'] / GiB:.2f} GiB is free; "
                "put more on disk or use a smaller batch")


def oom_record(e: BaseException, policy: Policy, device: torch.device) -> dict[str, object]:
    """What running out of GPU memory looked like, for benchmarks' records: the policy, torch's
    message, the allocator's state while the failing step's tensors are still alive, and the
    innermost flexoff frames (which step allocated)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "site-packages" not in f.filename and "/torch/" not in f.filename]
    rec: dict[str, object] = {"policy": policy.describe(), "message": " ".join(str(e).split())[:600],
                              "frames": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-5:]]}
    if device.type == "cuda":
        rec.update({k: round(v / GiB, 3) for k, v in (
            ("allocated_GiB", torch.cuda.memory_allocated(device)), ("reserved_GiB", torch.cuda.memory_reserved(device)),
            ("peak_allocated_GiB", torch.cuda.max_memory_allocated(device)),
            ("peak_reserved_GiB", torch.cuda.max_memory_reserved(device)))})
    return rec
