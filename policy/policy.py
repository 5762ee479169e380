"""The Policy: a plan for placing and scheduling one model run, as data.

Knows: FlexGen's policy fields (batch shape, placement percentages of weights,
KV cache and activations on GPU / CPU / disk, compression, CPU attention,
overlap), ours (training's stash placement, the blocks' worth of LoRA adapters
read from files that host memory keeps), their validation, and their JSON form.
Does not know: how a policy is executed (offload/ does that) or found (search).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from flexoff.errors import PolicyError

ACT_LOAD_SLOTS = 2  # act_load_slots' default
GPU_RESERVE = 1 << 30  # GPU bytes left to the CUDA allocator's slack and fragmentation (plan and cost model)
# blocks' worth of LoRA adapters read from files that host memory keeps by default (one running,
# the next read while it runs); a job's blocks group rows by adapter, so each such adapter is read
# about once. A policy may keep one (`lora_cache_blocks`): the host memory of a block's adapters
# for the KV cache or weights, the next block's read when it begins (what fits beside is read ahead)
CACHE_BLOCKS = 2
# how far two percentages as describe() prints them (six significant digits) may sum beyond 100:
# a policy a search found must parse back (39.3% on the GPU, 2.08333 and 97.9167 of the
# activations); shares that sum to 100 or more leave nothing to the disk
PRINTED_SLACK = 1e-3
PERCENT_FIELDS = ("w_gpu_percent", "w_cpu_percent", "cache_gpu_percent",
                  "cache_cpu_percent", "act_gpu_percent", "act_cpu_percent")


def weight_slots(cpu_cache_compute: bool) -> int:
    """GPU slots the engine stages non-resident layers through: two (this layer and the next), or
    four with CPU attention, where decode starts an attention layer's first batch while the layer
    before it and the one before that still finish their last batch. `FLEXOFF_WEIGHT_SLOTS` sets
    the count (for measurements; with three or more, layers are staged two ahead)."""
    return int(os.environ.get("FLEXOFF_WEIGHT_SLOTS", 4 if cpu_cache_compute else 2))


def act_load_slots(all_gpu: bool) -> int:
    """Device buffers a GPU batch's hidden state is loaded back into from CPU or disk rows (a
    ring: the input being computed on and the next batch's, on its way); none where every row
    stays on the GPU. `FLEXOFF_LOAD_SLOTS` sets the ring's length; 0 loads into a fresh tensor
    from the load stream's memory pool each time (the compute stream cannot reuse that memory,
    and at the memory cap the CUDA allocator stalls the host to free it)."""
    return 0 if all_gpu else int(os.environ.get("FLEXOFF_LOAD_SLOTS", ACT_LOAD_SLOTS))


def step_load_slots(all_gpu: bool, num_gpu_batches: int) -> int:
    """Device buffers of one token's rows that a GPU batch's hidden state is loaded back into in
    token steps (a second ring, beside act_load_slots' whole-sequence one): a load into a slot
    waits for the compute that read it last, and on the load stream that wait holds up the KV
    cache rows queued behind it; with one batch more than a layer's, and one spare, a load waits
    only for compute of the layer before. None where every row stays on the GPU.
    `FLEXOFF_STEP_SLOTS` sets the count (0: token steps load into the other ring, as before)."""
    return 0 if all_gpu else int(os.environ.get("FLEXOFF_STEP_SLOTS", num_gpu_batches + 2))


def keeps_token_steps() -> bool:
    """Whether a token step's hidden state (one token's rows, a few MB for a block) stays whole on
    the compute device between layers, whatever the activations' placement, rather than going to
    its CPU and disk rows and loading back: the load waited for the store of an output compute had
    just made, and held up the cache and weight copies queued behind it on the load stream.
    The step ring (step_load_slots) is then unused; its room covers the kept outputs.
    `FLEXOFF_KEEP_STEPS=0` stores and loads them as the placement says."""
    return os.environ.get("FLEXOFF_KEEP_STEPS", "1") != "0"


def cache_slots(cpu_cache_compute: bool, num_gpu_batches: int) -> int:
    """GPU slots the engine loads a (layer, batch)'s staged KV rows into: two (this step's and the
    next's) where the GPU attends over CPU rows; with CPU attention only disk rows are staged (few),
    and there is one per GPU batch and one more, so the next attention layer's rows load from disk
    while the MLP layer before it runs."""
    return num_gpu_batches + 1 if cpu_cache_compute else 2


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int = 1  # sequences computed together on the GPU
    num_gpu_batches: int = 1  # GPU batches in one block (block size = product)
    w_gpu_percent: float = 100.0  # weights: % of each layer's bytes on the GPU
    w_cpu_percent: float = 0.0  # ... on the CPU; the rest on disk
    cache_gpu_percent: float = 100.0  # KV cache: % of each batch's sequences on the GPU
    cache_cpu_percent: float = 0.0  # ... on the CPU; the rest on disk
    act_gpu_percent: float = 100.0  # activations between layers, likewise
    act_cpu_percent: float = 0.0
    compress_weight: bool = False  # 4-bit group-wise weights
    compress_cache: bool = False  # 4-bit group-wise KV cache
    cpu_cache_compute: bool = False  # decode attention on the CPU where the cache lives there
    overlap: bool = True  # overlap transfers with compute
    quant_bits: int = 4  # bits per value when compressing
    quant_group: int = 64  # values per group when compressing
    stash_gpu_percent: float = 100.0  # training: % of each batch's stashed layer inputs on the GPU
    stash_cpu_percent: float = 0.0  # ... on the CPU; the rest on disk
    lora_cache_blocks: int = CACHE_BLOCKS  # blocks' worth of LoRA adapters read from files kept in host memory

    def __post_init__(self) -> None:
        for name in ("gpu_batch_size", "num_gpu_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PolicyError(f"{name} must be a positive integer, got {v!r}")
        for name in PERCENT_FIELDS + ("stash_gpu_percent", "stash_cpu_percent"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 100:
                raise PolicyError(f"{name} must be a number from 0 to 100, got {v!r}")
        for what in ("w", "cache", "act", "stash"):
            total = getattr(self, f"{what}_gpu_percent") + getattr(self, f"{what}_cpu_percent")
            if total > 100 + PRINTED_SLACK:
                raise PolicyError(f"{what}_gpu_percent + {what}_cpu_percent is {total:g}, over 100")
        for name in ("compress_weight", "compress_cache", "cpu_cache_compute", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.lora_cache_blocks, int) or isinstance(self.lora_cache_blocks, bool) \
                or self.lora_cache_blocks < 1:
            raise PolicyError(f"lora_cache_blocks must be a positive integer, got {self.lora_cache_blocks!r}")
        if isinstance(self.quant_bits, bool) or self.quant_bits not in (4, 8):
            raise PolicyError(f"quant_bits must be 4 or 8, got {self.quant_bits!r}")
        if not isinstance(self.quant_group, int) or isinstance(self.quant_group, bool) or self.quant_group < 2 \
                or self.quant_group % 2:
            raise PolicyError(f"quant_group must be an even integer >= 2, got {self.quant_group!r}")

    # ---- derived -------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def w_disk_percent(self) -> float:
        return max(0.0, 100.0 - self.w_gpu_percent - self.w_cpu_percent)

    @property
    def cache_disk_percent(self) -> float:
        return max(0.0, 100.0 - self.cache_gpu_percent - self.cache_cpu_percent)

    @property
    def act_disk_percent(self) -> float:
        return max(0.0, 100.0 - self.act_gpu_percent - self.act_cpu_percent)

    @property
    def percent(self) -> tuple[float, ...]:
        """FlexGen's --percent tuple (wg, wc, cg, cc, hg, hc)."""
        return tuple(getattr(self, f) for f in PERCENT_FIELDS)

    def describe(self) -> str:
        p = ", ".join(f"{x:g}" for x in self.percent)
        flags = [n for n in ("compress_weight", "compress_cache", "cpu_cache_compute") if getattr(self, n)]
        if not self.overlap:
            flags.append("no-overlap")
        if (self.stash_gpu_percent, self.stash_cpu_percent) != (100.0, 0.0):
            flags.append(f"stash {self.stash_gpu_percent:g}, {self.stash_cpu_percent:g}")
        if self.lora_cache_blocks != CACHE_BLOCKS:
            flags.append(f"lora cache {self.lora_cache_blocks} block" + "s" * (self.lora_cache_blocks > 1))
        return f"{self.gpu_batch_size}x{self.num_gpu_batches} ({p})" + (f" [{', '.join(flags)}]" if flags else "")

    # ---- JSON ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Policy":
        if not isinstance(d, dict):
            raise PolicyError("a policy must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PolicyError(f"unknown policy field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> "Policy":
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise PolicyError(f"cannot read policy file {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise PolicyError(f"policy file {path} is not valid JSON: {e.msg} (line {e.lineno})") from None
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    def with_percent(self, percent: tuple[float, ...]) -> "Policy":
        if len(percent) != 6:
            raise PolicyError("--percent takes six numbers: W_G W_C C_G C_C A_G A_C")
        return replace(self, **dict(zip(PERCENT_FIELDS, percent)))

    def replace(self, **changes: Any) -> "Policy":
        return replace(self, **changes)
