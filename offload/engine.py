"""The offload engine: runs blocks of sequences through a model under a Policy.

Knows: one loop that interprets a block's plan (offload.schedule) step by step, forward
sweeps (a token step of inference, a training window's forward) and reverse sweeps (its
backward) alike: for each step it starts the loads the plan names (the next layers'
weights, the next step's KV cache and input), has the layer's op compute (each layer kind's
forward or backward, offload.layer_ops), and keeps an overlap switch; the lanes, stores and
buffers that live as long as the engine; where a block is resident on the compute device
its decode runs through the lean path (offload.lean); prefill and decode timing; peak
memory per tier; as one stage of a pipeline, the block's batches in groups that follow each
other through the stages, every token step run (offload.pipeline); a co-served block, whose
training windows run their forward in the prefill's sweep and their reverse sweep before the
other batches decode; whether large copies are paced. Per-block state lives in a BlockRun
(offload.block), not here.
Does not know: layer kinds, tokenization, sampling rules or stop conditions (the caller
passes a sampler and an on_tokens callback), where prompts come from.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from flexoff.kernels import cpu_attention as cpu_kernel
from flexoff.kernels.cpu_attention import cpu_attention_threads
from flexoff.models.base import Family
from flexoff.models.spec import ModelSpec
from flexoff.offload.activations import HiddenStore, Stash, keeps_graphs
from flexoff.offload.adapters import AdapterPool, Need
from flexoff.offload.block import (IGNORE, BatchInput, BlockResult, BlockRun, Clock, LossTask, OnTokens,
                                   Sampler, SampleTask, TrainResult)
from flexoff.offload.host_io import HostIO
from flexoff.offload.kvcache import KVCodec, KVStore, PlainKV, cached_batches
from flexoff.offload.lanes import Event, Lanes
from flexoff.offload.layer_ops import layer_ops, prefill_chunk_tokens
from flexoff.offload.layout import Layout, PlainFormat, WeightFormat
from flexoff.offload.lean import LeanDecoder, graphs_enabled
from flexoff.offload.memory import MemoryPlan, check, plan_memory
from flexoff.offload.mover import Mover, holds_stores
from flexoff.offload.pipeline import PipeLink, batch_groups
from flexoff.offload.placement import ByteSplit
from flexoff.offload.schedule import Sweep, block_plan, forward_sweeps, training_sweeps
from flexoff.offload.tiers import Budgets, Ledger, Tiers
from flexoff.offload.weights import WeightStore, move_overhead, plan_weights
from flexoff.policy.policy import Policy, weight_slots

__all__ = ["Engine", "BatchInput", "BlockResult", "TrainResult", "cpu_attention_threads"]
SWITCH_INTERVAL = 2e-4  # seconds; Python's default is 5e-3
# Steps of whole sequences (a prefill, a training window's sweeps) whose compute the host may
# have issued beyond the one the GPU is on. Without a limit the host ran 4-7 such steps ahead;
# their outputs, freed while still queued for copies on other streams, held memory the CUDA
# allocator could not reuse until it ran into the GPU cap and drained every stream
# (RESULTS.md). Two is what the memory plan counts (ModelSpec.inflight_bytes).
HOST_AHEAD = 2


def adapter_bytes(need: Need, host: int, layouts: list[Layout], policy: Policy, dtype: torch.dtype) -> dict[str, int]:
    """Bytes a block's LoRA adapters take per tier: on the device the block's adapters (weights
    resident) or a page per weight slot (weights streamed); in host memory every loaded one."""
    paged = not all(s.resident for s in plan_weights(layouts, policy))
    return {"gpu": need.gpu_bytes(paged, weight_slots(policy.cpu_cache_compute), dtype.itemsize), "cpu": host}


class Engine:
    """One policy's machinery: lanes, KV cache, activation stores. It may borrow tiers and a
    weight store that outlive it (given ones are not released by close)."""

    def __init__(self, family: Family, spec: ModelSpec, policy: Policy, *, device: torch.device,
                 dtype: torch.dtype, max_prompt: int, max_gen: int, offload_dir: str | None = None,
                 budgets: Budgets | None = None, weight_format: WeightFormat | None = None,
                 kv_codec: KVCodec | None = None, tiers: Tiers | None = None,
                 weights: WeightStore | None = None, credit: dict[str, int] | None = None,
                 moving: list[ByteSplit] | None = None, training: bool = False,
                 cuda_graphs: bool | None = None, adapter_need: Need = Need(), adapter_host_bytes: int = 0,
                 pipe: PipeLink | None = None, windows: int | None = None):
        self.fam, self.spec, self.policy, self.device, self.dtype = family, spec, policy, device, dtype
        self.max_prompt, self.max_gen = max_prompt, max_gen
        self.chunk = prefill_chunk_tokens()  # tokens a prefill MLP (or lossy cache read) takes at once
        self.fmt = weight_format or PlainFormat(dtype)
        codec = kv_codec or PlainKV(spec.num_kv_heads, spec.head_dim, dtype)
        layouts = [Layout(self.fmt.fields(l)) for l in spec.layers]
        self.plan: MemoryPlan = plan_memory(spec, layouts, codec.rec_bytes, policy, max_prompt, max_gen,
                                            dtype, device.type == "cuda", training,
                                            adapter_bytes(adapter_need, adapter_host_bytes, layouts, policy, dtype),
                                            adapter_need.elements if training else 0, windows)
        self.adapter_need = adapter_need  # the room a block's LoRA adapters have on the compute device
        self.training = training  # made for training sweeps (a stash, or kept graphs)
        self.windows = windows  # of a block's GPU batches, how many may be training windows (None: all)
        if moving:  # an older store's layers (their splits) move in: each stays until it has moved
            self.plan.add("weights being moved", move_overhead(moving, plan_weights(layouts, policy)))
        # before anything is allocated; `credit` is memory already held that the plan counts
        check(self.plan, budgets or Budgets(), device, offload_dir, credit or {})
        # large copies are paced (offload.mover) for CPU attention's small copies to pass; elsewhere
        # pacing only slows them, its chunks waiting on the host (OPT-30B 16x24 compressed decoded at
        # 91.1 tok/s unpaced, 84.5 paced; an OPT-30B training step took 2.33 s unpaced, 2.64 s
        # paced; RESULTS.md)
        pace = os.environ.get("FLEXOFF_PACE", "auto")
        self.lanes = Lanes(device, pace=pace == "always" or pace == "auto" and policy.cpu_cache_compute)
        self._own_tiers, self._own_weights = tiers is None, weights is None
        self.tiers = tiers or Tiers(device, offload_dir)
        self.mem = Ledger(self.tiers)
        # stored outputs held until copied: the plan's in-flight outputs (offload.mover.holds_stores)
        hold = spec.inflight_bytes(policy.gpu_batch_size, max_prompt, dtype.itemsize) if holds_stores() else 0
        self.mover = Mover(self.lanes, self.mem, hold_bytes=hold)
        try:
            self.weights = weights or WeightStore(list(spec.layers), self.fmt, policy, self.tiers)
            self.weights.bind(self.lanes, self.mover)
            self.kv = KVStore(spec, codec, policy, self.mem, self.lanes, self.mover, max_prompt, max_gen,
                              cached_batches(policy, windows))
            self.hidden = HiddenStore(spec, dtype, policy, self.mem, self.lanes, self.mover, max_prompt)
            self.host_io = HostIO(self.lanes, self.mem, policy.gpu_batch_size, spec, dtype)
            self.stash = Stash(spec, dtype, policy, self.mem, self.lanes, self.mover, max_prompt, windows) \
                if training else None
        except BaseException:
            self.close()
            raise
        self.adapters: AdapterPool | None = None  # LoRA adapters the caller has loaded (set by it)
        self.weights.adapters = None
        self.keep_graphs = training and keeps_graphs(all(s.resident for s in self.weights.splits), policy)
        self.pipe = pipe  # this engine runs one stage of a pipeline (offload.pipeline)
        self.ops = layer_ops(self)
        self.lean = LeanDecoder(self, graphs_enabled(cuda_graphs)) \
            if pipe is None and LeanDecoder.applies(self) else None
        self.cpu_threads = cpu_attention_threads() if self.lanes.cuda and policy.cpu_cache_compute else 0
        if policy.cpu_cache_compute:  # build (or load) the CPU attention kernel now, not in a decode step
            cpu_kernel.enabled()
        self.cpu_attention_bytes = 0
        self.timing = {"wait_cpu_attention_s": 0.0, "cpu_attention_compute_s": 0.0, "cpu_attention_down_s": 0.0,
                       "cpu_attention_stage_s": 0.0, "cpu_attention_calls": 0,
                       "cpu_attention_idle_layer_s": 0.0, "cpu_attention_idle_batch_s": 0.0}

    # ---- setup ---------------------------------------------------------
    def load_weights(self, layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]]) -> None:
        """Store each (layer index, logical tensors) pair on its tiers."""
        for j, tensors in layers:
            self.weights.fill(j, tensors)

    def detach_weights(self) -> WeightStore:
        """Hand the weight store to the caller, who keeps it beyond this engine."""
        self._own_weights = False
        return self.weights

    def sync(self) -> None:
        """Wait for everything issued so far; the stored outputs held for their copies, all done
        now, are let go (offload.mover.holds_stores)."""
        self.lanes.sync()
        self.mover.settle()

    def close(self) -> None:
        """Stop the lanes and give back what this engine allocated (weights and tiers only if
        it owns them: unpinning host memory, removing the offload folder). Idempotent."""
        if hasattr(self, "lanes"):
            try:
                self.lanes.sync()  # nothing may still be copying into memory we release
            except Exception:  # a failed lane already raised where it mattered
                pass
            self.lanes.close()
        if hasattr(self, "mover"):
            self.mover.settle()
        if hasattr(self, "mem"):
            self.mem.release()
        if getattr(self, "_own_weights", False) and hasattr(self, "weights"):
            self.weights.release()
        if getattr(self, "_own_tiers", False) and hasattr(self, "tiers"):
            self.tiers.close()
        if getattr(self, "adapters", None) is not None:  # its device room was this engine's plan
            self.adapters.release()
        # drop the views of what was given back: a closed engine that is still referenced (by a
        # traceback's frames while the caller retries with a smaller policy, say) holds no memory
        for name in ("kv", "hidden", "host_io", "weights", "mover", "stash", "ops", "lean"):
            self.__dict__.pop(name, None)

    def peaks(self) -> dict[str, int]:
        """Peak bytes per tier: GPU from the allocator, CPU and disk from the engine's
        own accounting, and the process's peak resident memory."""
        out = self.tiers.peaks()
        if self.device.type == "cuda":
            out["gpu"] = torch.cuda.max_memory_allocated(self.device)
        out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return out

    # ---- running blocks ------------------------------------------------
    @contextmanager
    def _host_settings(self) -> Iterator[None]:
        """On CUDA the scheduling thread hands the GIL to the feed thread (paced weight copies, a
        chunk every 0.6 ms) and CPU attention's lanes many times a layer: a short switch interval
        keeps them from waiting the default 5 ms for it (link gaps of 4-8 ms were measured)."""
        if not self.lanes.cuda:
            yield
            return
        interval, threads = sys.getswitchinterval(), torch.get_num_threads()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
        try:
            yield
        finally:
            sys.setswitchinterval(interval)
            torch.set_num_threads(threads)  # the default for threads started later

    def _check_block(self, batches: Sequence[BatchInput], gen_len: int) -> None:
        p, S = self.policy, batches[0].ids.shape[1]
        assert 1 <= len(batches) <= p.num_gpu_batches and all(b.ids.shape[0] <= p.gpu_batch_size for b in batches)
        assert all(b.ids.shape[1] == S for b in batches) and S <= self.max_prompt and gen_len <= self.max_gen

    def run_block(self, batches: list[BatchInput], gen_len: int, sampler: Sampler, on_tokens: OnTokens,
                  prompt_logprobs: bool = False) -> BlockResult:
        """Generate up to gen_len tokens for every sequence of a block of GPU batches.

        Batches with labels, after the others, are training windows served in the same block
        (co-serving; an engine made with training=True): their forward runs in the prefill's
        sweep on the same weight loads, their reverse sweep follows it, then the other batches
        decode; result.train holds their loss and LoRA gradients (as run_train's)."""
        self._check_block(batches, gen_len)
        assert gen_len >= 1
        train = tuple(k for k, b in enumerate(batches) if b.labels is not None)
        infer = tuple(k for k, b in enumerate(batches) if b.labels is None)
        assert all(k > max(infer, default=-1) for k in train), "training windows come after inference batches"
        if train and (self.stash is None or self.pipe is not None or len(train) > (self.windows or len(batches))):
            raise RuntimeError("internal: co-served training needs an engine made with training=True (room for "
                               "its windows), no pipeline")
        if len(infer) > self.kv.batches:
            raise RuntimeError(f"internal: {len(infer)} inference batches in a block of an engine with KV cache "
                               f"homes for {self.kv.batches} (the others are training windows')")
        pipe = self.pipe
        if pipe is not None and not pipe.last:  # the last stage samples the tokens and sees them
            on_tokens = lambda i, tokens: False  # noqa: E731
        losses, tokens = self._loss_tasks([batches[k] for k in train])
        # an engine that trains runs every block without inference mode: what a block makes and
        # keeps (weight views, the lean path's buffers) must stay usable by a later window's autograd
        with self._host_settings(), torch.no_grad() if train or self.training else torch.inference_mode():
            t0 = time.perf_counter()  # the block's time includes making its state (its adapters read, placed)
            run = BlockRun(self, batches, gen_len, [SampleTask(sampler, k, prompt_logprobs) for k in infer] + losses)
            if train:
                self.stash.begin(train)
            clock = Clock(self, [run.states[k] for k in infer], on_tokens, t0)
            lean = self.lean is not None and gen_len > 1
            if train:  # the windows' reverse sweep right after the prefill; a stop takes effect after it
                decode = range(1, 1 if lean else gen_len)  # the lean path decodes on its own
                sweeps = [Sweep(0), Sweep(0, True, train)] + [Sweep(i, False, infer) for i in decode]
                done = lambda i: clock.token_step_done(i) and i >= 1  # noqa: E731
            elif pipe is None:
                sweeps, done = forward_sweeps(1 if lean else gen_len), clock.token_step_done
            else:  # every stage runs every token step: a stop seen by the last alone would hang the others
                sweeps = forward_sweeps(gen_len, batch_groups(len(batches), pipe.stages))
                done = lambda i: clock.token_step_done(i) and False  # noqa: E731
            try:
                self._execute(run, sweeps, done)
                if pipe is not None:
                    pipe.drain()
                if lean and not clock.stop:
                    self.lean.decode(run, gen_len, clock, infer)
                result = clock.finish()
            finally:
                self.hidden.clear()
                self.kv.reset()
                if self.stash is not None:
                    self.stash.clear()
        if train:
            parts = [float(t.loss) for t in losses]
            result.train = TrainResult(sum(parts), tokens, [run.grads[k] for k in train], run.lora_grads, parts)
        return result

    def _loss_tasks(self, batches: Sequence[BatchInput]) -> tuple[list[LossTask], int]:
        """The head tasks of training windows: each batch's summed loss over all their labelled
        tokens (so the batches' gradients add up to the mean's), and that count."""
        tokens = int(sum(int((b.labels != IGNORE).sum()) for b in batches))
        return [LossTask(b.labels.to(self.device), 1.0 / max(1, tokens)) for b in batches], tokens

    def run_train(self, batches: list[BatchInput]) -> TrainResult:
        """One training window per batch (its whole sequence): a forward sweep that stashes each
        layer's input, the loss of the labels, then a reverse sweep of vector-Jacobian products
        through the frozen layers. The engine must have been made with training=True."""
        if self.stash is None or self.pipe is not None:
            raise RuntimeError("internal: this engine was not made for training (training=True, no pipeline)")
        self._check_block(batches, 0)
        assert all(b.labels is not None for b in batches)
        tasks, tokens = self._loss_tasks(batches)
        with self._host_settings(), torch.no_grad():
            run = BlockRun(self, batches, 0, list(tasks))
            try:
                self._execute(run, training_sweeps(1), lambda i: False)
                self.sync()
            finally:
                self.hidden.clear()
                self.stash.clear()
        loss = float(sum(t.loss for t in tasks)) if tasks else 0.0
        return TrainResult(loss, tokens, list(run.grads), run.lora_grads)

    def _execute(self, run: BlockRun, sweeps: list[Sweep], sweep_done: Callable[[int], bool]) -> None:
        """Run the block's plan: FlexGen's loop, each step's loads issued ahead of its compute."""
        p, L, K = self.policy, len(self.spec.layers), len(run.states)
        slots = len(self.weights.slots)
        # with three or more slots weights are prefetched two layers ahead, issued at a layer's
        # second batch; with four (CPU attention), decode starts an attention layer's first batch
        # before the layer before it ends (batch 0's q, k, v join the CPU lane's queue behind the
        # last batch's attention instead of after it), and the two slots beyond cover the layers
        # still in use meanwhile
        ahead, at = (2, 1) if slots >= 3 else (1, 0)
        kinds = [layer.kind for layer in self.spec.layers]
        early = [j for j in range(1, L) if kinds[j] == "attn" and kinds[j - 1] == "mlp"] \
            if slots >= 4 and self.kv.cpu_compute and not run.training else []
        if p.overlap and sweeps:
            self.stage(run, L - 1 if sweeps[0].backward else 0)
        # staged KV rows (disk rows under CPU attention) load this many attention steps ahead, into
        # a ring of one slot more: the next layer's, while the MLP layer before it runs
        deep = self.kv.lookahead if p.overlap and self.kv.cpu_compute else 0
        if os.environ.get("FLEXOFF_CACHE_AHEAD") == "0":  # one step ahead only, for comparisons
            deep = min(deep, 1)
        depth = int(os.environ.get("FLEXOFF_HOST_AHEAD", HOST_AHEAD)) if p.overlap and self.lanes.cuda else 0
        issued: deque[Event] = deque()  # compute of the last whole-sequence steps, oldest first
        for plan in block_plan(sweeps, L, K, early=early, ahead=ahead if p.overlap else 0, at=at,
                               lookahead=2 * deep + 1):
            step = plan.step
            run.finish_where(lambda c: c.k == step.k)  # this batch's input
            if p.overlap:
                for j in (step.j,) + plan.stage:  # weights: this layer's (kept), the next ones'
                    self.stage(run, j)
                left = deep
                if plan.next is not None:  # the next step's cache and activations
                    self.ops[plan.next.j].load(run, step, plan.next)
                    left -= self.ops[plan.next.j].load_cache(run, plan.next)  # (already loading)
                for later in plan.upcoming[1:]:  # and the caches of the attention steps after it
                    if left <= 0:
                        break
                    left -= self.ops[later.j].load_cache(run, later)
            op = self.ops[step.j]
            op.backward(run, step) if step.backward else op.forward(run, step)
            if depth and (step.i == 0 or step.backward):  # see HOST_AHEAD
                issued.append(self.lanes.compute.mark())
                if len(issued) > depth:
                    issued.popleft().wait_host()
            if not p.overlap:
                run.finish_where(lambda c: True)
                self.sync()
            if plan.ends and not step.backward and sweep_done(step.i):
                break
        run.finish_where(lambda c: True)

    def stage(self, run: BlockRun, j: int) -> None:
        """Start copying layer j's weights into a slot, once the calls still reading the layer
        that slot holds have been finished (their compute issued, so the copy waits for it)."""
        held = self.weights.reuses(j)
        if held is not None:
            run.finish_where(lambda c: c.j == held)
        self.weights.prefetch(j)

    def traffic(self) -> dict[str, float]:
        """Bytes issued so far: by copy path, and KV bytes read by CPU attention; seconds the main
        thread waited for CPU attention and the CPU lane spent on it, and seconds the link was busy
        with the engine's host-to-device copies (CUDA), the CUDA allocator's retries (an
        allocation that found the memory cap reached, synchronized the device and freed its cache),
        the host's waits for a held store's copy (offload.mover.holds_stores) and their seconds,
        seconds the disk-read thread spent reading, and seconds the scheduling thread waited for
        a thread's work before the compute stream could wait for it (CUDA)."""
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.lanes.cuda else 0
        return {**self.mover.traffic, "cpu_attention": self.cpu_attention_bytes, **self.timing,
                "h2d_busy_s": self.mover.link_seconds(), "alloc_retries": retries,
                "store_hold_waits": self.mover.hold_waits, "store_hold_wait_s": self.mover.hold_wait_s,
                "disk_read_s": self.mover.disk_read_s, "compute_blocked_s": self.lanes.compute.blocked_s}
