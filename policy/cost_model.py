"""FlexGen's cost model (Appendix A.3), written against ModelSpec and our engine.

Knows: for a model, hardware, workload and the discrete part of a policy
(batch shape, compression, CPU attention, overlap), the time of each engine
layer in prefill and decode as the max (overlap on) or sum (off) of its
transfer and compute terms, and the peak memory of each tier; every term is
linear in the nine placement fractions, so the same code builds the LP's
constraints (with PuLP variables) and evaluates a concrete policy (floats).
Does not know: the LP solver or rounding (search.py), the engine.

Names follow the FlexGen paper:

| name | meaning |
|------|---------|
| wg, wc, wd | fraction of each layer's weight bytes on GPU, CPU, disk |
| cg, cc, cd | fraction of each GPU batch's KV-cache rows on GPU, CPU, disk |
| hg, hc, hd | fraction of each GPU batch's activation rows on GPU, CPU, disk |
| l | transformer layers (the engine runs 2l + 2 layers: embed, attn and mlp per block, head) |
| s, n | prompt length, tokens generated per sequence |
| bls, gbs | block size (gbs x number of GPU batches), GPU batch size |
| h1, h2, nh | hidden size, MLP hidden size, attention heads |
| ctog_bdw, gtoc_bdw, dtoc_bdw, ctod_bdw | CPU->GPU, GPU->CPU, disk->CPU, CPU->disk bandwidths; in decode, CPU->GPU at the rate the profile measured the engine's decode copies at (decode_ctog_bdw, not in FlexGen); disk->CPU from the page cache (dtoc_cached_bdw, at most PAGE_CACHE_READ_BDW; not in FlexGen) for a model built `cached_disk`, whose placements keep the host tiers within PAGE_CACHE_SHARE of host memory |
| mm_flops, bmm_flops | GPU matmul and batched-matmul FLOP/s (p: prefill shapes, at the model's hidden size where measured; g: decode) |
| E, gpu_mem_bdw | a layer's elementwise bytes per token (norms, residuals, activations, head moves) over the device's rate for them (not in FlexGen) |
| cpu_flops, cpu_attn_bdw | CPU attention FLOP/s, and the KV bytes/s it reads |
| cpu_mem_bdw, host_read_bdw | bytes/s of a host memcpy (read plus write); host memory serves the link's copies and CPU attention's reads together at the profile's measured host_read_bdw, else at HOST_READ_OVER_MEMCPY times cpu_mem_bdw (decode pairs; not in FlexGen) |
| ctog, gtoc, dtoc, ctod, comp | a layer's seconds of each transfer, and of compute |
| host, host_step_s, packed_host_step_s, lora_host_step_s | a layer's seconds of host work: one engine step per GPU batch (with 4-bit weights, the packed step), and what LoRA adds to a step; over a decode pair, combined with the link's seconds as a norm (HOST_WEIGHT, HOST_NORM) (not in FlexGen) |
| lora_W, lora_F | LoRA: bytes of the adapters a block uses on every linear, and delta FLOPs per token (not in FlexGen); held on the GPU beside resident weights (with the next block's, staged while a block runs, for a job of several blocks), else paged with each layer's weights (link traffic, a page per weight slot); in host memory the held adapters and a cache of `lora_cache_blocks` blocks' of those read from files; with one block, each later block's reads at dtoc_bdw before its prefill (lora_read_s) |
| T_pre, T_gen | a layer's prefill time, and its average decode time per token |
| T | block latency: sum over layers of T_pre + (n - 1) T_gen |
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Mapping

from flexoff.models.spec import ModelSpec
from flexoff.policy.hardware import Hardware
from flexoff.policy.policy import (CACHE_BLOCKS, GPU_RESERVE, act_load_slots, cache_slots, keeps_token_steps,
                                   step_load_slots, weight_slots)
from flexoff.quant.sizes import kv_config, kv_record_bytes, layer_bytes, tensor_bytes, weight_config

VARS = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd")
# the largest share of a decode that the engine's CPU attention lane was busy where it bound:
# 0.88-0.89 on the H200 (OPT-30B, 12x6 and 24x3 with (nearly) all of the cache in CPU memory),
# 0.93 and 0.96 on H100s (OPT-30B 24x3 at 8bcc5d5 and 800e76b; benchmarks/RESULTS.md, 2026-11-27)
CPU_LANE_SHARE = 0.96
# host memory serves reads alone (the link's copies out of it, CPU attention's cache reads) faster
# than cpu_mem_bdw, a memcpy's rate counting each byte read and written: OPT-30B's CPU-attention
# decodes on an H100 read 1.25x it (24x3: 95.6 GB/s where the profile's memcpy moved 76.3) with
# the link and CPU attention each at its own profiled rate, so not at a limit. An estimate of the
# limit, not a measurement: a copy whose writes first read their lines moves three bytes for the
# two it counts. Used where the profile has no host_read_bdw (measured since 2026-11-27's eleventh
# session: 100.3 GB/s on an H100 host whose memcpy moved 94.2)
HOST_READ_OVER_MEMCPY = 1.5
# seconds of the CPU attention lane per call (one GPU batch of one attention layer) beyond its
# reads: the hand-off, the copies in and out of the pinned buffers, the thread's Python. Measured
# by benchmarks/cpu_lane.py on an H100 (OPT-30B cut to 8 blocks, the cache in CPU memory, calls of
# 4 to 48 rows): 0.42 ms a call plus its bytes at 48.1 GB/s with the link busy, 0.30 ms plus 57.0
# with it idle (benchmarks/RESULTS.md, tenth session of 2026-11-27). It was 1 ms, fitted to five
# decodes whose profiles took the CPU attention rate after the engine probes, four of them before
# token steps kept their hidden states on the GPU
CPU_ATTN_CALL_S = 0.4e-3
# bytes/s the engine's disk-read thread gets out of the page cache in a decode, at most: 32 MiB
# reads into pinned buffers beside the link's copies (and CPU attention's reads, where it runs).
# Over the 33 OPT-30B decodes that read the disk tier in eight sessions' H100 records
# (benchmarks/results/2026-11-27[e-l]-h100) it read 2.4-4.3 GB/s, median 3.5, whatever the
# profile's read of the page cache alone (3.4-7.5 GB/s); the profile's rate, where lower, still
# prices it
PAGE_CACHE_READ_BDW = 3.5e9
# the share of host memory that the CPU tier and the disk tier together may fill for the disk
# tier's files to stay in the page cache (the rest: the process's own memory, the system's)
PAGE_CACHE_SHARE = 0.9
# a decode pair's link seconds L and its host seconds H (the model's host term, one engine step
# per GPU batch and layer) overlap imperfectly: the link waits at the cache ring for steps the
# host has not issued yet, more so the nearer H comes to L. The pair takes (L^p + (w H)^p)^(1/p).
# Fitted to OPT-30B's 4-bit decode on H100s (benchmarks/RESULTS.md): 80x4, 32x12 and 24x16, with
# H at 0.23, 0.60 and 0.81 of L, took 1.01, 1.055 and 1.16 of L; (w, p) = (1.2, 4) gives 1.00,
# 1.06 and 1.17
HOST_WEIGHT, HOST_NORM = 1.2, 4
# a decode pair under CPU attention with several GPU batches takes longer than the larger of its
# link's and its lane's busy time: the GPU waits for a layer's last call, and the link for the
# weight slot that waits on the GPU. Over OPT-30B's CPU-attention decodes of 2026-11-25 and 27
# without cache rows on disk (benchmarks/RESULTS.md), the excess was 0.15 (0.12-0.23) of one call
# (the lane's seconds over the batches) at two GPU batches and 0.02 (0.01-0.04) at three: this
# share over the cube of (batches - 1). With disk rows it was larger, but too unevenly to price
# (0.03-0.49 of a call more)
CPU_CALL_EXPOSED = 0.15
KINDS = ("embed", "attn", "mlp", "head")


def host_read_bdw(hw: Hardware) -> float:
    """Bytes/s at which host memory serves the link's copies and CPU attention's reads together:
    the profile's measurement where it has one, else HOST_READ_OVER_MEMCPY times cpu_mem_bdw."""
    return hw.host_read_bdw or HOST_READ_OVER_MEMCPY * hw.cpu_mem_bdw


def page_cache_copy_s(nbytes: Any, hw: Hardware) -> Any:
    """Seconds of host memory that buffered disk reads of `nbytes` take beside the link's copies
    and CPU attention's reads: the kernel copies each byte out of the page cache, reading and
    writing it (the engine reads the disk tier with preadv). CPU attention's lane loses them:
    in the 13 sessions whose OPT-30B decodes on H100s and H200s ran CPU attention both with and
    without disk reads (benchmarks/results/2026-11-2*), the lane read the cache 0.96x as fast in
    those with (the median of the sessions' ratios of median rates; 0.79-1.11); net of these
    seconds, 1.00x (0.82-1.15)."""
    return 2 * nbytes / host_read_bdw(hw)


@dataclass(frozen=True)
class Workload:
    prompt_len: int  # s
    gen_len: int  # n
    elem_bytes: int = 2  # compute dtype
    num_prompts: int | None = None  # sequences in the job (None: unbounded)
    lora_ranks: tuple[float, ...] = ()  # LoRA adapters the job uses: each one's rank on every linear layer
    lora_held: float | None = None  # of their ranks' sum, the adapters held in memory (None: all); the
    # rest are read from files into a host cache of CACHE_BLOCKS blocks' adapters


def lora_per_block(work: Workload, bls: int) -> tuple[int, float]:
    """How many adapters a block of bls rows uses, and their mean rank. Rows are grouped by
    adapter, so a block of bls out of N rows spread over A adapters uses about bls * A / N + 1."""
    ranks = work.lora_ranks
    if not ranks:
        return 0, 0.0
    used = min(len(ranks), bls)
    if work.num_prompts:
        used = min(used, -(-bls * len(ranks) // work.num_prompts) + 1)
    return used, sum(ranks) / len(ranks)


def lora_staged(work: Workload, bls: int) -> bool:
    """Whether a job of blocks of bls rows holds the next block's adapters on the GPU beside the
    current block's (resident weights: staged while a block runs, when there is a next block)."""
    return bool(work.lora_ranks) and (work.num_prompts is None or work.num_prompts > bls)


def lora_host_ranks(work: Workload, bls: int, blocks: int = CACHE_BLOCKS) -> float:
    """The adapters' host memory as a sum of ranks on every linear layer: the held ones, and of
    those read from files the cache of `blocks` blocks' adapters and the largest one's more (all
    of them, if fewer)."""
    used, mean = lora_per_block(work, bls)
    return lora_held_ranks(work) + min(lora_file_ranks(work), blocks * used * mean + max(work.lora_ranks, default=0))


def lora_held_ranks(work: Workload) -> float:
    """Of the adapters' ranks, those held in memory (the rest are read from files)."""
    total = sum(work.lora_ranks)
    return total if work.lora_held is None else work.lora_held


def lora_file_ranks(work: Workload) -> float:
    """Of the adapters' ranks, those read from files."""
    return sum(work.lora_ranks) - lora_held_ranks(work)


def lora_cache_options(work: Workload, bls: int) -> tuple[int, ...]:
    """The host caches a job of blocks of bls rows may keep of adapters read from files, in
    blocks: CACHE_BLOCKS, and one (the next block's adapters read when it begins) where the job
    reads adapters from files and has several blocks whose adapters CACHE_BLOCKS would not all hold."""
    used, mean = lora_per_block(work, bls)
    one = lora_staged(work, bls) and lora_file_ranks(work) > used * mean + max(work.lora_ranks)
    return (CACHE_BLOCKS, 1) if one else (CACHE_BLOCKS,)


@dataclass(frozen=True)
class Choice:
    """The discrete part of a policy, fixed while the LP picks the placement."""

    gpu_batch_size: int
    num_gpu_batches: int
    compress_weight: bool = False
    compress_cache: bool = False
    cpu_cache_compute: bool = False
    overlap: bool = True
    quant_bits: int = 4
    quant_group: int = 64
    lora_cache_blocks: int = CACHE_BLOCKS  # blocks' worth of adapters read from files kept in host memory

    @property
    def bls(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches


@dataclass
class Prediction:
    prefill_s: float  # block prefill time
    decode_s: float  # block decode time
    throughput: float  # generated tokens / s over the whole job
    bottleneck: str  # the largest term of the layer kind that dominates decode
    memory: dict[str, float]  # peak bytes per tier
    terms: dict[str, dict[str, float]]  # "stage/kind" -> term -> seconds (one layer)

    @property
    def latency(self) -> float:
        return self.prefill_s + self.decode_s


class CostModel:
    vars = VARS  # the LP's placement fractions
    lora_read_s = 0.0  # seconds a block waits for its adapters' reads before its prefill

    def __init__(self, spec: ModelSpec, hw: Hardware, work: Workload, choice: Choice, cached_disk: bool = False):
        self.spec, self.hw, self.work, self.ch = spec, hw, work, choice
        self._read_disk(cached_disk)
        eb = work.elem_bytes
        wq = weight_config(choice.quant_bits, choice.quant_group) if choice.compress_weight else None
        kq = kv_config(choice.quant_bits, choice.quant_group, spec.head_dim) if choice.compress_cache else None
        self.count = {k: sum(1 for l in spec.layers if l.kind == k) for k in KINDS}
        # a kind's first layer; a pipeline stage may lack the embedding or the head (count 0: costs 0)
        first = {k: next((j for j, l in enumerate(spec.layers) if l.kind == k), None) for k in KINDS}
        self.W = {k: layer_bytes(spec.layers[first[k]], eb, wq) if first[k] is not None else 0 for k in KINDS}
        self.W_dense = {k: layer_bytes(spec.layers[first[k]], eb) if first[k] is not None else 0 for k in KINDS}
        self.F = {k: spec.linear_flops(first[k]) if first[k] is not None else 0 for k in KINDS}  # per token
        self.mm_p = hw.prefill_mm_flops(spec.hidden_size)  # FLOP/s of matmuls at this model's prefill shapes
        # seconds per token of each kind's elementwise passes (0 where the profile has no rate)
        self.E = {k: spec.elementwise_bytes(first[k], eb) / hw.gpu_mem_bdw if first[k] is not None and hw.gpu_mem_bdw
                  else 0.0 for k in KINDS}
        self.kv = kv_record_bytes(spec.num_kv_heads, spec.head_dim, eb, kq)  # stored, per token per layer
        self.kv_dense = kv_record_bytes(spec.num_kv_heads, spec.head_dim, eb)
        self.A = spec.hidden_size * eb  # activation bytes per token
        self.keep_steps = keeps_token_steps()  # token steps' hidden states stay on the GPU: none move
        self.Q = spec.num_heads * spec.head_dim * eb  # query / attention output bytes per token
        self.W_total = sum(self.count[k] * self.W[k] for k in KINDS)
        self.W_max = max(self.W.values())
        # each kind's tensors in the engine's order: a streamed layer is staged into its GPU slot
        # from the first tensor that the layer's GPU share does not hold whole
        self.tensors = {k: [tensor_bytes(t, eb, wq) for t in spec.layers[first[k]].tensors] if first[k] is not None
                        else [] for k in KINDS}
        self.slots = weight_slots(choice.cpu_cache_compute)  # the engine's GPU weight slots
        self.cache_slots = cache_slots(choice.cpu_cache_compute, choice.num_gpu_batches)
        # with CPU attention the engine loads an attention layer's disk rows while the MLP layer
        # before it runs (a ring of cache slots): their reads are priced over the (attn, mlp) pair
        self.cache_ahead = choice.cpu_cache_compute and choice.overlap and self.count["attn"] == self.count["mlp"] > 0
        # and with several GPU batches, one batch's CPU attention runs beside the GPU work and
        # copies of the next: it is priced over the pair too
        self.cpu_pooled = self.cache_ahead and choice.num_gpu_batches > 1
        # where the GPU attends over staged (CPU, disk) rows of several GPU batches, the rows load
        # one attention step ahead through a ring of two slots, in step order on one stream: the
        # next attention layer's first two batches load while the MLP layer before it runs, and
        # the third waits for the first one's attention (staged_idle). Priced over the pair too.
        self.staged_pool = not choice.cpu_cache_compute and choice.overlap and choice.num_gpu_batches > 1 \
            and self.count["attn"] == self.count["mlp"] > 0
        self.pooled = self.cache_ahead or self.staged_pool  # staged rows priced over the pair
        # LoRA: the adapters a block uses, of the mean rank; each row's delta FLOPs per token
        used, mean = lora_per_block(work, choice.bls)
        width = {k: spec.lora_width(first[k]) if first[k] is not None else 0 for k in KINDS}
        self.lora_layer = {k: used * mean * width[k] * eb for k in KINDS}  # bytes per layer
        per_rank = sum(spec.lora_width(j) for j in range(len(spec.layers))) * eb  # bytes of rank 1 on every layer
        self.lora_bytes = used * mean * per_rank
        self.lora_stage = self.lora_bytes if lora_staged(work, choice.bls) else 0.0  # the next block's, staged
        self.lora_F = {k: 2 * mean * width[k] for k in KINDS}
        # the held adapters' host copies, and the cache of those read from files, whatever the placement
        self.lora_host = lora_host_ranks(work, choice.bls, choice.lora_cache_blocks) * per_rank
        # a cache of one block: each later block's adapters read from their files when it begins
        if choice.lora_cache_blocks < 2 and lora_staged(work, choice.bls):
            blocks = -(-work.num_prompts // choice.bls) if work.num_prompts else None
            share = lora_file_ranks(work) / sum(work.lora_ranks)
            self.lora_read_s = self.lora_bytes * share / hw.dtoc_bdw * ((blocks - 1) / blocks if blocks else 1.0)

    # ---- the LP's view ---------------------------------------------------
    def sweep_count(self, stage: str) -> int:
        """How often a block runs each layer in this stage: once in the prefill, n - 1 decode steps."""
        return 1 if stage == "p" else self.work.gen_len - 1

    def bounds(self) -> dict[str, tuple[float, float]]:
        """Placement fractions the discrete choice bounds, (low, high) (none for inference)."""
        return {}

    def preference(self, x: Mapping[str, Any]) -> Any:
        """A negligible cost added to the LP's objective to pick among equal placements (none)."""
        return 0

    # ---- time ----------------------------------------------------------
    def terms(self, x: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        """Seconds of each term of one layer of each kind, in prefill ("p") and decode ("g")."""
        hw, ch, spec = self.hw, self.ch, self.spec
        s, n, bls = self.work.prompt_len, self.work.gen_len, ch.bls
        ctx = s + n / 2  # average context during decode
        cpu_attn = ch.cpu_cache_compute
        staged = x["cd"] + (0 if cpu_attn else x["cc"])  # cache rows copied to the GPU to attend
        on_gpu = x["cg"] + staged  # cache rows attended on the GPU
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for k in KINDS:
            attn, W, Wd = k == "attn", self.W[k], self.W_dense[k]
            h_in, h_out = k != "embed", k != "head"  # layers that load / store activations
            deq_w = Wd / hw.dequant_bdw if ch.compress_weight else 0
            for stage in ("p", "g"):
                tok = s if stage == "p" else 1  # tokens per sequence this step
                act = 0.0 if stage == "g" and self.keep_steps else bls * tok * self.A
                link = hw.ctog_bdw if stage == "p" else hw.decode_link_bdw(cpu_attn)
                t = {  # streamed weights bring the block's LoRA pages of the layer along
                    "ctog": ((x["wc"] + x["wd"]) * (W + self.lora_layer[k]) + (x["hc"] + x["hd"]) * act * h_in)
                    / link,
                    "gtoc": (x["hc"] + x["hd"]) * act * h_out / hw.gtoc_bdw_hidden,
                    "dtoc": (x["wd"] * W + x["hd"] * act * h_in) / self.dtoc_bdw,
                    "ctod": x["hd"] * act * h_out / hw.ctod_bdw_hidden,
                }
                rows = 1 if (stage == "p" and k == "head") else tok  # the head sees the last token only
                gpu = bls * rows * (self.F[k] + self.lora_F[k]) / (self.mm_p if stage == "p" else hw.mm_flops_g) \
                    + deq_w + bls * rows * self.E[k]
                cpu = 0.0
                if attn and stage == "p":
                    t["gtoc"] += (x["cc"] + x["cd"]) * bls * s * self.kv / hw.gtoc_bdw_cache
                    t["ctod"] += x["cd"] * bls * s * self.kv / hw.ctod_bdw_cache
                    gpu += bls * spec.attn_flops(1) * s * (s + 1) / 2 / hw.bmm_flops_p
                    if ch.compress_cache:
                        gpu += bls * s * self.kv_dense / hw.dequant_bdw
                elif attn:
                    if not self.pooled:  # else over the pair of layers (cache_pool)
                        t["ctog"] += staged * bls * ctx * self.kv / link
                        t["dtoc"] += x["cd"] * bls * ctx * self.kv / self.dtoc_bdw
                    t["gtoc"] += staged * bls * self.kv / hw.gtoc_bdw_cache
                    t["ctod"] += x["cd"] * bls * self.kv / hw.ctod_bdw_cache
                    gpu += on_gpu * bls * spec.attn_flops(ctx) / hw.bmm_flops_g
                    if ch.compress_cache:
                        gpu += on_gpu * bls * ctx * self.kv_dense / hw.dequant_bdw
                    if cpu_attn:  # q and new k, v go down; the output comes back
                        t["gtoc"] += x["cc"] * bls * (self.Q + self.kv_dense) / hw.gtoc_bdw_hidden
                        t["ctog"] += x["cc"] * bls * self.Q / link
                        if not self.cpu_pooled:  # else over the pair of layers (cache_pool)
                            cpu = self.cpu_attention(x)[1]
                # the schedule's own work per step, and what LoRA adds to it (wrapping, launches)
                t["host"] = ch.num_gpu_batches * (hw.step_host_s(ch.compress_weight)
                                                  + (hw.lora_host_step_s if self.lora_F[k] else 0.0))
                if ch.num_gpu_batches > 1:  # CPU attention of one batch overlaps the next's GPU work
                    t["comp"], t["cpu_comp"] = gpu, cpu
                else:
                    t["comp"] = gpu + cpu
                out[(stage, k)] = t
        return out

    def cpu_attention(self, x: Mapping[str, Any]) -> tuple[Any, Any]:
        """Decode CPU attention of one attention layer: the cache bytes it reads, and its seconds
        (one call per GPU batch, each CPU_ATTN_CALL_S beyond its reads, and the host memory that
        the disk reads of its (attn, mlp) pair take, page_cache_copy_s)."""
        hw, bls, ctx = self.hw, self.ch.bls, self.work.prompt_len + self.work.gen_len / 2
        read = x["cc"] * bls * ctx * self.kv
        sec = read / hw.cpu_attn_bdw + self.ch.num_gpu_batches * CPU_ATTN_CALL_S \
            + page_cache_copy_s(self.pair_disk_bytes(x), hw)
        if self.ch.compress_cache:
            sec += x["cc"] * bls * ctx * self.kv_dense / hw.cpu_dequant_bdw
        return read, sec

    def cache_pool(self, x: Mapping[str, Any],
                   terms: Mapping[tuple[str, str], Mapping[str, Any]]) -> dict[str, Any]:
        """Decode's work that an (attn, mlp) pair of layers shares, by term; the pair takes at
        least as long as each. Where the engine loads cache rows ahead (CPU attention, overlap
        on): the seconds the pair keeps the link and the disk busy, its own layers' bytes and
        the attention layer's staged cache rows (read from disk and copied to the GPU while
        either layer runs); the attention layer's CPU attention, which runs beside the next
        layer's GPU work and copies when the block has several GPU batches (`cpu_comp`; the
        lane waits for each batch's queries, so it is busy CPU_LANE_SHARE of the pair at most); and
        host memory (`cpu_mem`), which the link's copies out of it and CPU attention's reads
        share, at host_read_bdw (the profile's measurement, else HOST_READ_OVER_MEMCPY times
        `cpu_mem_bdw`), and the disk reads' copies out of the page cache. With the GPU
        attending over staged rows of several GPU batches (overlap on), the link and host
        memory terms alike. The host's work for the pair's steps,
        weighted by HOST_WEIGHT (for the LP a bound the pair keeps; pair_pool combines it with
        the link's). Where the GPU attends over staged rows, their disk reads add to the link's
        time: rows load one step ahead only, and a step's compute waits on the host for its
        rows' read (OPT-30B 4-bit 48x10 with 8% of the cache on disk decoded its pairs at 0.70
        of the larger of the two on an H100, its host blocked 18 ms a pair;
        benchmarks/RESULTS.md). Under CPU attention over several GPU batches, the link's term
        also holds what the link waits beyond its bytes (CPU_CALL_EXPOSED). Empty where rows
        are not priced over the pair."""
        if not self.pooled:
            return {}
        hw = self.hw
        disk, rows = self.staged_bytes(x)
        attn, mlp = terms[("g", "attn")], terms[("g", "mlp")]
        rate = hw.decode_link_bdw(self.ch.cpu_cache_compute)
        link = attn["ctog"] + mlp["ctog"] + rows / rate
        reads = disk / self.dtoc_bdw  # under GPU attention read one step ahead: added to the link's
        read, sec = self.cpu_attention(x) if self.ch.cpu_cache_compute else (0, 0)
        out = {"ctog": link + (reads if self.staged_pool else 0), "dtoc": attn["dtoc"] + mlp["dtoc"] + reads,
               "cpu_mem": (link * rate + read) / host_read_bdw(hw) + page_cache_copy_s(self.pair_disk_bytes(x), hw),
               "host": HOST_WEIGHT * (attn["host"] + mlp["host"])}
        if self.cpu_pooled:
            out["cpu_comp"] = sec / CPU_LANE_SHARE
            nb = self.ch.num_gpu_batches  # what the link waits beyond its bytes (CPU_CALL_EXPOSED)
            out["ctog"] += CPU_CALL_EXPOSED / (nb - 1) ** 3 * sec / nb
        return out

    def pair_disk_bytes(self, x: Mapping[str, Any]) -> Any:
        """Decode bytes an (attn, mlp) pair of layers reads from the disk tier: its weights there
        and the attention layer's cache rows there (hidden states on disk left out: token steps
        keep them on the GPU)."""
        return x["wd"] * (self.W["attn"] + self.W["mlp"]) + self.staged_bytes(x)[0]

    def staged_bytes(self, x: Mapping[str, Any]) -> tuple[Any, Any]:
        """Decode bytes of one attention layer's staged cache rows, at the average context: those
        read from disk, and all that are copied to the GPU (disk rows only under CPU attention)."""
        per = self.ch.bls * (self.work.prompt_len + self.work.gen_len / 2) * self.kv
        return x["cd"] * per, (x["cd"] + (0 if self.ch.cpu_cache_compute else x["cc"])) * per

    def staged_idle(self, x: Mapping[str, float], terms: Mapping[tuple[str, str], Mapping[str, float]]) -> float:
        """Seconds a decode pair's link idles where the GPU attends over staged rows of several
        GPU batches: the rows load one attention step ahead into a ring of two slots, so the
        next attention layer's third batch waits until its first one's attention frees a slot.
        That is two attention steps and the MLP layer between them on the GPU; meanwhile the
        link carries the first two batches' rows and the pair's own layer copies (weights,
        hidden states), whose slots free during the same stretch. (The host, ahead of the GPU
        where the link binds, is not on this path.) 0 where it does not apply (no staged rows,
        one GPU batch, CPU attention, overlap off); floats only: the LP prices the pair by
        cache_pool."""
        rows = self.staged_bytes(x)[1]
        if not self.staged_pool or rows <= 0:
            return 0.0
        nb, attn, mlp = self.ch.num_gpu_batches, terms[("g", "attn")], terms[("g", "mlp")]
        copy = rows / self.hw.decode_link_bdw() / nb  # one batch's staged rows
        return max(0.0, 2 * attn["comp"] / nb + mlp["comp"] - 2 * copy - attn["ctog"] - mlp["ctog"])

    def pair_pool(self, x: Mapping[str, float], terms: Mapping[tuple[str, str], Mapping[str, float]]) -> tuple[str, float]:
        """A concrete placement's largest shared term of a decode pair, by name: cache_pool's,
        the link's with the staged rows' idle added and combined with the host's as the
        HOST_NORM-norm of the two (named after the larger); ("", 0) where none applies."""
        pool = dict(self.cache_pool(x, terms))
        if "ctog" in pool:
            link, host = pool["ctog"] + self.staged_idle(x, terms), pool.pop("host", 0.0)
            pool["host" if host > link else "ctog"] = (link ** HOST_NORM + host ** HOST_NORM) ** (1 / HOST_NORM)
        return max(pool.items(), key=lambda kv: kv[1], default=("", 0.0))

    def pooled_traffic(self, x: Mapping[str, Any]) -> Any:
        """Seconds of transfers per decode pair that cache_pool adds to the layers' own terms."""
        if not self.pooled:
            return 0
        disk, rows = self.staged_bytes(x)
        return rows / self.hw.decode_link_bdw(self.ch.cpu_cache_compute) + disk / self.dtoc_bdw

    # ---- memory --------------------------------------------------------
    def constraints(self, x: Mapping[str, Any]) -> dict[str, Any]:
        """Expressions the placement must keep at or below 0 besides the tiers' budgets: for a
        model that reads the disk from the page cache, the CPU and disk tiers within
        PAGE_CACHE_SHARE of host memory."""
        if not self.cached_disk:
            return {}
        mem = self.memory(x)
        return {"page_cache": mem["cpu"] + mem["disk"] - PAGE_CACHE_SHARE * self.hw.cpu_mem}

    def cache_memory(self, x: Mapping[str, Any]) -> dict[str, Any]:
        """The KV cache's bytes on each tier: every batch's homes, and the GPU slots staged rows
        load into."""
        ch, tokens = self.ch, self.work.prompt_len + self.work.gen_len
        cache = ch.bls * tokens * self.kv * self.count["attn"]
        staged = x["cd"] + (0 if ch.cpu_cache_compute else x["cc"])
        return {"gpu": x["cg"] * cache + self.cache_slots * ch.gpu_batch_size * staged * tokens * self.kv,
                "cpu": x["cc"] * cache, "disk": x["cd"] * cache}

    def memory(self, x: Mapping[str, Any]) -> dict[str, Any]:
        """Peak bytes of each tier, as the engine allocates them."""
        ch, s = self.ch, self.work.prompt_len
        act = ch.bls * s * self.A
        working = self.spec.working_bytes(ch.gpu_batch_size, s, self.work.elem_bytes, self.hw.device)
        working += GPU_RESERVE if self.hw.device == "cuda" else 0
        if ch.compress_weight:  # dequantized at matmul shapes: a weight, or a layer its GPU batches share
            working += self.spec.dequantized_bytes(self.work.elem_bytes, ch.num_gpu_batches > 1)
        working += self.spec.inflight_bytes(ch.gpu_batch_size, s, self.work.elem_bytes)
        cache = self.cache_memory(x)
        return {
            "gpu": x["wg"] * self.W_total + self.slots * self.slot_bytes(x["wg"]) + cache["gpu"]
            + x["hg"] * act + self.load_ring_bytes(x["hg"]) + working
            + x["wg"] * (self.lora_bytes + self.lora_stage) + self.slots * (1 - x["wg"]) * max(self.lora_layer.values()),
            "cpu": x["wc"] * self.W_total + cache["cpu"] + x["hc"] * act + self.lora_host,
            "disk": x["wd"] * self.W_total + cache["disk"] + x["hd"] * act,
        }

    def load_ring_bytes(self, hg: Any) -> int:
        """The GPU buffers a batch's CPU and disk hidden rows load back into (offload.activations),
        whole sequences and token steps: for the LP always, for a concrete share unless it keeps
        every row on the GPU, as the engine rounds rows."""
        n = self.ch.gpu_batch_size
        all_gpu = isinstance(hg, (int, float)) and math.floor(n * hg + 0.5) >= n
        tokens = act_load_slots(all_gpu) * self.work.prompt_len + step_load_slots(all_gpu, self.ch.num_gpu_batches)
        return tokens * n * self.A

    def slot_bytes(self, wg: Any) -> Any:
        """A GPU weight slot: the largest layer's bytes beyond its GPU share; for the LP, that
        share's complement (linear), and for a concrete share, counted from the first tensor the
        share does not hold whole, as the engine stages it (up to a tensor more)."""
        if not isinstance(wg, (int, float)):
            return (1 - wg) * self.W_max
        out = 0
        for sizes in self.tensors.values():
            held, start = round(sum(sizes) * wg), 0
            for b in sizes:
                if start + b > held:
                    break
                start += b
            out = max(out, sum(sizes) - start)
        return out

    # ---- evaluation ----------------------------------------------------
    def layer_time(self, t: Mapping[str, float]) -> float:
        return max(t.values()) if self.ch.overlap else sum(t.values())

    def evaluate(self, x: Mapping[str, float]) -> Prediction:
        n = self.work.gen_len
        terms = self.terms(x)
        pre = sum(self.count[k] * self.layer_time(terms[("p", k)]) for k in KINDS)
        gen = sum(self.count[k] * self.layer_time(terms[("g", k)]) for k in KINDS)
        pair = self.layer_time(terms[("g", "attn")]) + self.layer_time(terms[("g", "mlp")])
        pool = self.pair_pool(x, terms)
        gen += self.count["attn"] * max(0.0, pool[1] - pair)  # pairs the shared transfers hold up
        decode = (n - 1) * gen
        pre += self.lora_read_s
        worst = max(KINDS, key=lambda k: self.count[k] * self.layer_time(terms[("g" if n > 1 else "p", k)]))
        stage = "g" if n > 1 else "p"
        term = max(terms[(stage, worst)].items(), key=lambda kv: kv[1])[0]
        where = f"{pool[0]} (attn, mlp pairs)" if n > 1 and pool[1] > pair else f"{term} ({worst} layers)"
        return Prediction(pre, decode, self.throughput(pre + decode), where,
                          {t: float(v) for t, v in self.memory(x).items()},
                          {f"{st}/{k}": {a: float(b) for a, b in v.items()} for (st, k), v in terms.items()})

    def _read_disk(self, cached: bool) -> None:
        """Price disk reads from the page cache (`cached`: placements must leave it room, see
        constraints) or from the device; the page cache gives the engine PAGE_CACHE_READ_BDW at
        most (never less than the device's rate)."""
        rate = self.hw.disk_read_bdw(cached)
        if rate > self.hw.dtoc_bdw:
            rate = max(self.hw.dtoc_bdw, min(rate, PAGE_CACHE_READ_BDW))
        self.cached_disk, self.dtoc_bdw = cached, rate

    def price(self, x: Mapping[str, float]) -> Prediction:
        """evaluate(x), with disk reads from the page cache where the profile measured it faster
        and the placement leaves it room for the disk tier (as a model built `cached_disk`)."""
        if not self.cached_disk and self.hw.page_cache_faster():
            cached = copy.copy(self)
            cached._read_disk(True)
            if cached.holds(x):
                return cached.evaluate(x)
        return self.evaluate(x)

    def holds(self, x: Mapping[str, float]) -> bool:
        """Whether a concrete placement keeps this model's constraints."""
        return all(v <= 0 for v in self.constraints(x).values())

    def throughput(self, block_latency: float) -> float:
        """Generated tokens per second over the job: whole blocks of bls sequences."""
        bls, n, N = self.ch.bls, self.work.gen_len, self.work.num_prompts
        if N is None:
            return bls * n / block_latency
        blocks = -(-N // bls)
        return N * n / (blocks * block_latency)
