"""The offload engine: runs blocks of sequences through a model under a Policy.

Knows: FlexGen's zig-zag block schedule in one loop with an overlap switch:
for each token step, layer and GPU batch it prefetches the next layer's
weights, loads the next batch's KV cache and activations, computes this batch
and stores what it produced, each on its own lane, ordered by events; decode
attention on the CPU next to a CPU-resident cache, overlapped with the next
batches' GPU work: its inputs go down on a lane of their own (overlapping the
call before), its output is read from mapped host memory when its batch needs
it, and each attention layer's first batch starts before the layer before ends,
so the CPU lane always has the next call queued; prefill and decode timing;
peak memory per tier.
Does not know: tokenization, sampling rules or stop conditions (the caller
passes a sampler and an on_tokens callback), where prompts come from.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from flexoff.models.attention import attend, attend_cached, positions, prefill_mask
from flexoff.models.base import Family
from flexoff.models.spec import ModelSpec
from flexoff.offload.activations import HiddenStore
from flexoff.offload.kvcache import KVCodec, KVStore, PlainKV
from flexoff.offload.lanes import DONE, Event, Lanes
from flexoff.offload.layout import Layout, PlainFormat, WeightFormat
from flexoff.offload.memory import HOST_IO_SETS, MemoryPlan, check, plan_memory
from flexoff.offload.mover import Mover
from flexoff.offload.placement import ByteSplit
from flexoff.offload.schedule import Step, zigzag
from flexoff.offload.tiers import Budgets, Ledger, Tiers
from flexoff.offload.weights import WeightStore, move_overhead, plan_weights
from flexoff.policy.policy import Policy

Sampler = Callable[[torch.Tensor, int, int], torch.Tensor]  # (logits (n, V), batch, step) -> ids (n,)
OnTokens = Callable[[int, list[torch.Tensor]], bool]  # (step, host ids per batch) -> stop?
SWITCH_INTERVAL = 2e-4  # seconds; Python's default is 5e-3


def cpu_attention_threads() -> int:
    """Threads CPU attention computes with next to a GPU: FLEXOFF_CPU_THREADS, or three quarters
    of torch's threads, leaving cores to the threads that drive the GPU (an OpenMP team that
    shares a core with them waits for its slowest member at every operation)."""
    env = os.environ.get("FLEXOFF_CPU_THREADS")
    return max(1, int(env) if env else torch.get_num_threads() * 3 // 4)


@dataclass
class BatchInput:
    ids: torch.Tensor  # (n, s) int64 prompt ids, left-padded
    valid: torch.Tensor  # (n, s) bool, False on padding


@dataclass
class BlockResult:
    prefill_s: float
    decode_s: float
    steps: int  # token steps run (the first is the prefill)
    prompt_logprobs: list[torch.Tensor | None] = field(default_factory=list)  # per batch (n, s-1)
    traffic_prefill: dict[str, int] = field(default_factory=dict)  # bytes moved by path, and read by CPU attention
    traffic_decode: dict[str, int] = field(default_factory=dict)


class _Batch:
    """Per-block state of one GPU batch."""

    def __init__(self, inp: BatchInput, gen_len: int, device: torch.device, pin: bool):
        self.n, self.S = inp.ids.shape
        valid = torch.ones(self.n, self.S + gen_len, dtype=torch.bool)
        valid[:, :self.S] = inp.valid
        self.valid_host = valid
        self.valid = valid.to(device)
        self.ids = inp.ids.to(device)
        self.pos0 = positions(self.valid[:, :self.S])  # (n, S)
        self.plen = self.valid[:, :self.S].sum(1)  # real prompt tokens per row
        self.mask0 = prefill_mask(self.valid[:, :self.S])  # (n, S, S)
        self.tokens = torch.zeros(gen_len, self.n, dtype=torch.long, device=device)
        self.tokens_host = torch.zeros(gen_len, self.n, dtype=torch.long, pin_memory=pin)
        self.logprobs: torch.Tensor | None = None

    def inputs(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions fed to the embedding at step i."""
        if i == 0:
            return self.ids, self.pos0
        return self.tokens[i - 1][:, None], (self.plen + (i - 1))[:, None]


@dataclass
class _Pending:
    """A CPU attention call of batch k at layer j, through buffer set `buffers`; finish() waits
    for it and issues the rest of the layer (its output read onto the device, the projection)."""
    k: int
    j: int
    buffers: int
    finish: Callable[[], None]


class _DevicePointer:
    """A registered host buffer as a CUDA array: under unified addressing, registered host memory is
    mapped into the device's address space at the same address, so kernels can read it directly."""

    def __init__(self, t: torch.Tensor):
        self.host = t  # the engine's Ledger keeps the memory itself until the engine closes
        self.__cuda_array_interface__ = {"shape": (t.numel(),), "typestr": "|u1", "data": (t.data_ptr(), False),
                                         "version": 2}


class _HostIO:
    """Pinned buffers through which CPU attention receives q, k, v and returns its output. Two sets,
    used by alternate calls, so one call's copies overlap the previous call's attention. Inputs go
    down on a stream of their own. The attention thread stages its output in pinned memory; once
    the call has finished, the scheduling thread has a kernel on the compute stream read it from
    the mapped host buffer. Not a copy: measured on the H200, a host-to-device copy of it, on any
    stream, waited until the weight copy in flight drained (5-15 ms), and the calls behind it with it.
    Where the buffer cannot be mapped it is copied."""

    SETS = HOST_IO_SETS

    def __init__(self, lanes: Lanes, mem: Ledger, rows: int, spec: ModelSpec, dtype: torch.dtype):
        self.cuda, self.device, self.dtype, self.lanes = lanes.cuda, mem.device, dtype, lanes
        self.free: list[list[Event]] = [[] for _ in range(self.SETS)]  # when each set may be refilled
        self.next = 0
        self.fetched = [True] * self.SETS  # whether each set's last output has been read
        self.mapped: list[torch.Tensor] | None = None  # each set's output buffer, as the device sees it
        if self.cuda:
            qn, kvn = rows * spec.num_heads * spec.head_dim, rows * spec.num_kv_heads * spec.head_dim
            raw = [[mem.alloc("cpu", n * dtype.itemsize) for n in (qn, kvn, kvn, qn)] for _ in range(self.SETS)]
            self.bufs = [[b.view(dtype) for b in bs] for bs in raw]
            self.down = torch.cuda.Stream(self.device)
            try:
                self.mapped = [torch.as_tensor(_DevicePointer(bs[3]), device=self.device) for bs in raw]
            except (RuntimeError, TypeError):  # no unified addressing (or no NumPy for the interface)
                self.mapped = None

    def take(self) -> tuple[int, list[Event]]:
        """The buffer set for the next call, and what must finish before it is refilled."""
        s = self.next
        if not self.fetched[s]:
            raise RuntimeError("internal: a CPU attention buffer set was reused before its output was read")
        self.next = (s + 1) % self.SETS
        self.fetched[s] = not self.cuda
        return s, self.free[s]

    def to_host(self, s: int, *ts: torch.Tensor) -> list[torch.Tensor]:
        if not self.cuda:
            return list(ts)
        out = []
        with torch.cuda.stream(self.down):
            for t, buf in zip(ts, self.bufs[s]):
                h = buf[:t.numel()].view(t.shape)
                h.copy_(t, non_blocking=True)
                out.append(h)
            self.down.synchronize()
        return out

    def stage(self, s: int, o: torch.Tensor) -> torch.Tensor:
        """On the attention thread: the output o in set s's pinned buffer."""
        if not self.cuda:
            return o
        h = self.bufs[s][3][:o.numel()].view(o.shape)
        h.copy_(o)
        return h

    def fetch(self, s: int, h: torch.Tensor) -> torch.Tensor:
        """On the scheduling thread, once the call has finished: set s's staged output h on the
        device, read on the compute stream; the set may be refilled once that read is done."""
        if not self.cuda:
            return h
        if self.mapped is None:
            d = h.to(self.device, non_blocking=True)
        else:
            n = h.numel() * h.element_size()
            src = self.mapped[s][:n]
            if n % 4 == 0:  # a word per thread: fewer reads across the link
                src = src.view(torch.int32)
            d = torch.add(src, 0).view(self.dtype).view(h.shape)  # a kernel reads the host buffer
        self.free[s] = self.free[s] + [self.lanes.compute.mark()]
        self.fetched[s] = True
        return d


class _Clock:
    """Token-step bookkeeping of one block: tokens copied to the host one step behind, the stop
    callback, the prefill/decode split of time and traffic."""

    def __init__(self, engine: "Engine", states: list[_Batch], on_tokens: OnTokens):
        self.engine, self.states, self.on_tokens = engine, states, on_tokens
        self.events: list[Event] = []
        self.delivered, self.steps, self.stop = -1, 0, False
        self.start = self.after_prefill = engine.traffic()
        self.t0 = time.perf_counter()
        self.prefill_s = 0.0

    def _deliver(self, d: int) -> None:
        self.events[d].wait_host()
        self.stop = self.on_tokens(d, [st.tokens_host[d] for st in self.states])
        self.delivered = d

    def token_step_done(self, i: int) -> bool:
        """Step i's tokens are sampled; returns whether every sequence has stopped."""
        e = self.engine
        self.steps = i + 1
        with torch.profiler.record_function(f"flexoff: token step {i} issued"):  # a mark for traces
            pass
        for st in self.states:
            st.tokens_host[i].copy_(st.tokens[i], non_blocking=True)
        self.events.append(e.lanes.compute.mark())
        if i == 0:  # the prefill's end: measured, and its tokens checked at once
            e.lanes.sync()
            self.prefill_s = time.perf_counter() - self.t0
            self.after_prefill = e.traffic()
            self._deliver(0)
        elif i - 1 > self.delivered:  # the previous step's tokens, already on the host
            self._deliver(i - 1)
        return self.stop

    def finish(self, states: list[_Batch]) -> BlockResult:
        e = self.engine
        e.lanes.sync()
        end = time.perf_counter()
        for d in range(self.delivered + 1, self.steps):
            if not self.stop:
                self._deliver(d)
        e.hidden.clear()
        e.kv.reset()
        lps = [st.logprobs.cpu() if st.logprobs is not None else None for st in states]
        done, start, mid = e.traffic(), self.start, self.after_prefill
        return BlockResult(self.prefill_s, end - self.t0 - self.prefill_s, self.steps, lps,
                           {k: mid[k] - start[k] for k in start}, {k: done[k] - mid[k] for k in start})


class Engine:
    """One policy's machinery: lanes, KV cache, activation stores. It may borrow tiers and a
    weight store that outlive it (given ones are not released by close)."""

    def __init__(self, family: Family, spec: ModelSpec, policy: Policy, *, device: torch.device,
                 dtype: torch.dtype, max_prompt: int, max_gen: int, offload_dir: str | None = None,
                 budgets: Budgets | None = None, weight_format: WeightFormat | None = None,
                 kv_codec: KVCodec | None = None, tiers: Tiers | None = None,
                 weights: WeightStore | None = None, credit: dict[str, int] | None = None,
                 moving: list[ByteSplit] | None = None):
        self.fam, self.spec, self.policy, self.device, self.dtype = family, spec, policy, device, dtype
        self.max_prompt, self.max_gen = max_prompt, max_gen
        self.fmt = weight_format or PlainFormat(dtype)
        codec = kv_codec or PlainKV(spec.num_kv_heads, spec.head_dim, dtype)
        layouts = [Layout(self.fmt.fields(l)) for l in spec.layers]
        self.plan: MemoryPlan = plan_memory(spec, layouts, codec.rec_bytes, policy, max_prompt, max_gen,
                                            dtype, device.type == "cuda")
        if moving:  # an older store's layers (their splits) move in: each stays until it has moved
            self.plan.add("weights being moved", move_overhead(moving, plan_weights(layouts, policy)))
        # before anything is allocated; `credit` is memory already held that the plan counts
        check(self.plan, budgets or Budgets(), device, offload_dir, credit or {})
        self.lanes = Lanes(device)
        self._own_tiers, self._own_weights = tiers is None, weights is None
        self.tiers = tiers or Tiers(device, offload_dir)
        self.mem = Ledger(self.tiers)
        self.mover = Mover(self.lanes, self.mem)
        try:
            self.weights = weights or WeightStore(list(spec.layers), self.fmt, policy, self.tiers)
            self.weights.bind(self.lanes, self.mover)
            self.kv = KVStore(spec, codec, policy, self.mem, self.lanes, self.mover, max_prompt, max_gen)
            self.hidden = HiddenStore(spec, dtype, policy, self.mem, self.lanes, self.mover, max_prompt)
            self.host_io = _HostIO(self.lanes, self.mem, policy.gpu_batch_size, spec, dtype)
        except BaseException:
            self.close()
            raise
        self._sampler: Sampler | None = None
        self._cpu_threads = cpu_attention_threads() if self.lanes.cuda and policy.cpu_cache_compute else 0
        self.cpu_attention_bytes = 0
        self.timing = {"wait_cpu_attention_s": 0.0, "cpu_attention_compute_s": 0.0, "cpu_attention_down_s": 0.0,
                       "cpu_attention_stage_s": 0.0, "cpu_attention_calls": 0,
                       "cpu_attention_idle_layer_s": 0.0, "cpu_attention_idle_batch_s": 0.0}
        self._cpu_free_at: float | None = None  # when the CPU attention lane last finished a call
        self._pending: list[_Pending] = []  # CPU attention calls whose output is not yet used

    # ---- setup ---------------------------------------------------------
    def load_weights(self, layers: Iterable[tuple[int, Mapping[str, torch.Tensor]]]) -> None:
        """Store each (layer index, logical tensors) pair on its tiers."""
        for j, tensors in layers:
            self.weights.fill(j, tensors)

    def detach_weights(self) -> WeightStore:
        """Hand the weight store to the caller, who keeps it beyond this engine."""
        self._own_weights = False
        return self.weights

    def close(self) -> None:
        """Stop the lanes and give back what this engine allocated (weights and tiers only if
        it owns them: unpinning host memory, removing the offload folder). Idempotent."""
        if hasattr(self, "lanes"):
            try:
                self.lanes.sync()  # nothing may still be copying into memory we release
            except Exception:  # a failed lane already raised where it mattered
                pass
            self.lanes.close()
        if hasattr(self, "mem"):
            self.mem.release()
        if getattr(self, "_own_weights", False) and hasattr(self, "weights"):
            self.weights.release()
        if getattr(self, "_own_tiers", False) and hasattr(self, "tiers"):
            self.tiers.close()
        # drop the views of what was given back: a closed engine that is still referenced (by a
        # traceback's frames while the caller retries with a smaller policy, say) holds no memory
        for name in ("kv", "hidden", "host_io", "weights", "mover"):
            self.__dict__.pop(name, None)

    def peaks(self) -> dict[str, int]:
        """Peak bytes per tier: GPU from the allocator, CPU and disk from the engine's
        own accounting, and the process's peak resident memory."""
        out = self.tiers.peaks()
        if self.device.type == "cuda":
            out["gpu"] = torch.cuda.max_memory_allocated(self.device)
        out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return out

    # ---- the block schedule --------------------------------------------
    def run_block(self, batches: list[BatchInput], gen_len: int, sampler: Sampler, on_tokens: OnTokens,
                  prompt_logprobs: bool = False) -> BlockResult:
        """Generate up to gen_len tokens for every sequence of a block of GPU batches."""
        if not self.lanes.cuda:
            return self._run(batches, gen_len, sampler, on_tokens, prompt_logprobs)
        # the scheduling thread hands the GIL to the feed thread (paced weight copies, a chunk
        # every 0.6 ms) and CPU attention's lanes many times a layer: a short switch interval
        # keeps them from waiting the default 5 ms for it (link gaps of 4-8 ms were measured)
        interval, threads = sys.getswitchinterval(), torch.get_num_threads()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
        try:
            return self._run(batches, gen_len, sampler, on_tokens, prompt_logprobs)
        finally:
            sys.setswitchinterval(interval)
            torch.set_num_threads(threads)  # the default for threads started later

    def _run(self, batches: list[BatchInput], gen_len: int, sampler: Sampler, on_tokens: OnTokens,
             prompt_logprobs: bool) -> BlockResult:
        p, L, K = self.policy, len(self.spec.layers), len(batches)
        S = batches[0].ids.shape[1]
        assert 1 <= K <= p.num_gpu_batches and all(b.ids.shape[0] <= p.gpu_batch_size for b in batches)
        assert all(b.ids.shape[1] == S for b in batches) and S <= self.max_prompt and 1 <= gen_len <= self.max_gen
        self._sampler, self._want_lp = sampler, prompt_logprobs
        pin = self.device.type == "cuda"
        states = [_Batch(b, gen_len, self.device, pin) for b in batches]
        clock = _Clock(self, states, on_tokens)
        self._pending = []
        if p.overlap:
            self.weights.prefetch(0)
        slots = len(self.weights.slots)
        # with three or more slots weights are prefetched two layers ahead, issued at a layer's
        # second batch; with four (CPU attention), decode starts an attention layer's first batch
        # before the layer before it ends (batch 0's q, k, v join the CPU lane's queue behind the
        # last batch's attention instead of after it), and the two slots beyond cover the layers
        # still in use meanwhile
        ahead, at = (2, min(1, K - 1)) if slots >= 3 else (1, 0)
        kinds = [layer.kind for layer in self.spec.layers]
        early = [j for j in range(1, L) if kinds[j] == "attn" and kinds[j - 1] == "mlp"] \
            if slots >= 4 and self.kv.cpu_compute else []
        self._cpu_free_at = None
        for step, nxt in zigzag(gen_len, L, K, early):
            i, j, k = step
            self._finish_where(lambda c: c.k == k)  # this batch's input
            if p.overlap:
                self._prefetch(step, nxt, states, gen_len, ahead if k == at else 0)
            if kinds[j] == "attn" and i >= 1:  # a CPU attention call takes the next buffer set
                self._finish_where(lambda c: c.buffers == self.host_io.next)
            cont = self._compute(step, states[k])
            if cont is not None:
                self._pending.append(cont)
            if not p.overlap:
                self._finish_where(lambda c: True)
                self.lanes.sync()
            if j == L - 1 and k == K - 1 and clock.token_step_done(i):
                break
        self._finish_where(lambda c: True)
        return clock.finish(states)

    def traffic(self) -> dict[str, float]:
        """Bytes issued so far: by copy path, and KV bytes read by CPU attention; seconds the main
        thread waited for CPU attention and the CPU lane spent on it, and seconds the link was busy
        with the engine's host-to-device copies (CUDA)."""
        return {**self.mover.traffic, "cpu_attention": self.cpu_attention_bytes, **self.timing,
                "h2d_busy_s": self.mover.link_seconds()}

    def _finish_where(self, which: Callable[[_Pending], bool]) -> None:
        """Finish the pending CPU attention calls `which` picks, oldest first: wait for each and
        issue its layer's remaining compute."""
        for c in [c for c in self._pending if which(c)]:
            self._pending.remove(c)
            t0 = time.perf_counter()
            c.finish()
            self.timing["wait_cpu_attention_s"] += time.perf_counter() - t0

    def _stage(self, j: int) -> None:
        """Start copying layer j's weights into a slot, once the calls still reading the layer
        that slot holds have been finished (their compute issued, so the copy waits for it)."""
        held = self.weights.reuses(j)
        if held is not None:
            self._finish_where(lambda c: c.j == held)
        self.weights.prefetch(j)

    def _prefetch(self, step: Step, nxt: Step | None, states: list[_Batch], gen_len: int, ahead: int) -> None:
        """Issue the loads for what comes next, overlapping this step's compute: the weights of
        the `ahead` layers after this one (wrapping to the next token step), the next batch's
        KV cache and hidden state."""
        i, j, k = step
        L = len(self.spec.layers)
        for d in range(1, ahead + 1):
            if j + d < L:
                self._stage(j + d)
            elif i + 1 < gen_len:
                self._stage(j + d - L)
        if nxt is None:
            return
        ni, nj, nk = nxt
        st = states[nk]
        if self.spec.layers[nj].kind == "attn" and ni >= 1:
            self.kv.load(self.kv.layer_index[nj], nk, st.n, st.S + ni - 1)
        self._prefetch_hidden(step, nxt)

    def _prefetch_hidden(self, step: Step, nxt: Step | None) -> None:
        """Load the next batch's input if it is computed (not for the same batch: its input
        is what this step produces)."""
        if nxt is not None and nxt.j >= 1 and nxt.k != step.k and self.hidden.holds(nxt.k, nxt.j - 1):
            self.hidden.prefetch(nxt.k, nxt.j)

    def _compute(self, step: Step, st: _Batch) -> _Pending | None:
        i, j, k = step
        kind = self.spec.layers[j].kind
        self._stage(j)  # a no-op if staged already
        w, deps = self.weights.get(j)
        if kind == "embed":
            self.lanes.compute.wait(deps)
            ids, pos = st.inputs(i)
            self._finish_layer(j, k, self.fam.embed(w, ids, pos))
            return None
        h, hdeps = self.hidden.take(k, j)
        self.lanes.compute.wait(deps + hdeps)
        if kind == "mlp":
            self._finish_layer(j, k, self.fam.mlp(w, h))
            return None
        if kind == "head":
            if i == 0 and self._want_lp:
                st.logprobs = self._prompt_logprobs(w, h, st)
            logits = self.fam.head(w, h[:, -1:])[:, 0]  # (n, vocab)
            st.tokens[i] = self._sampler(logits, k, i)
            self.weights.was_read(j, self.lanes.compute.mark())
            return None
        return self._attention(step, st, w, h)

    def _finish_layer(self, j: int, k: int, h: torch.Tensor) -> None:
        ev = self.lanes.compute.mark()
        self.weights.was_read(j, ev)
        self.hidden.put(k, j, h, ev)

    def _attention(self, step: Step, st: _Batch, w: Mapping[str, Any], h: torch.Tensor) -> _Pending | None:
        i, j, k = step
        fam, kv, li = self.fam, self.kv, self.kv.layer_index[j]
        q, kk, vv = fam.attn_in(w, h, st.inputs(i)[1])
        if i == 0:  # prefill: store the keys, attend over them as stored (a lossy codec's values)
            kv.store_prompt(li, k, st.n, kk, vv, self.lanes.compute.mark())
            o = attend(q, *kv.codec.roundtrip(kk, vv), st.mask0, fam.scale)
            self._finish_layer(j, k, fam.attn_out(w, h, o))
            return None
        t = st.S + i - 1  # position of the new token
        mask = st.valid[:, None, :t + 1]
        outs: list[Any] = []
        cpu: tuple[Event, dict[str, torch.Tensor]] | None = None
        for tier, r0, r1 in kv.segments(st.n):
            if tier == "cpu" and kv.cpu_compute:
                cpu = self._cpu_attention(li, k, st, q[r0:r1], kk[r0:r1], vv[r0:r1], r0, r1, t)
                outs.append(None)
                continue
            buf, deps = kv.device_buffer(li, k, st.n, tier, t)
            self.lanes.compute.wait(deps)
            kv.codec.write(buf, r1 - r0, t, kk[r0:r1], vv[r0:r1])
            K, V = kv.codec.read(buf, r1 - r0, t + 1)
            outs.append(attend(q[r0:r1], K, V, mask[r0:r1], fam.scale))
            if tier != "gpu":
                kv.stored_new_token(li, k, tier, r1 - r0, t, self.lanes.compute.mark())
        kv.release(li, k)

        def finish() -> None:
            if cpu is not None:
                ev, box = cpu
                ev.wait_host()
                outs[outs.index(None)] = self.host_io.fetch(box["set"], box["o"])
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            self._finish_layer(j, k, fam.attn_out(w, h, o))

        if cpu is None:
            finish()
            return None
        return _Pending(k, j, cpu[1]["set"], finish)

    def _cpu_attention(self, li: int, kb: int, st: _Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       r0: int, r1: int, t: int) -> tuple[Event, dict[str, Any]]:
        """Decode attention for CPU-resident rows on the CPU lane: an event for its output
        (rows, heads, 1, d), which is box["o"] once the event resolves (staged in buffer set
        box["set"], for host_io.fetch)."""
        seg, codec, io, kv = self.kv.homes[li][kb]["cpu"], self.kv.cpu_codec, self.host_io, self.kv
        rows, scale, timing = r1 - r0, self.fam.scale, self.timing
        mask = st.valid_host[r0:r1, None, :t + 1]
        cap = kv.split["cpu"]
        threads = self._cpu_threads
        lanes, buf, free = self.lanes, *io.take()
        box: dict[str, Any] = {"set": buf}  # "o": the output, put there by attention()

        def down() -> list[torch.Tensor]:
            t0 = time.perf_counter()
            out = io.to_host(buf, q, k, v)
            timing["cpu_attention_down_s"] += time.perf_counter() - t0
            return out

        def attention() -> Event:
            if threads and torch.get_num_threads() != threads:  # per thread: set on the lane's own
                torch.set_num_threads(threads)
            qh, kh, vh = got.result()
            t0 = time.perf_counter()
            if self._cpu_free_at is not None:  # the lane's idle time since its last call, by where
                timing["cpu_attention_idle_layer_s" if kb == 0 else "cpu_attention_idle_batch_s"] += \
                    t0 - self._cpu_free_at
            if kv.head_major:  # the prompt area, then the generated tokens so far
                o = attend_cached(qh, codec.prompt(seg.buf, rows, st.S), codec.generated(seg.buf, rows, cap),
                                  (kh, vh), t - st.S, mask, scale)
            else:
                codec.write(seg.buf, rows, t, kh, vh)
                o = attend(qh, *codec.read(seg.buf, rows, t + 1), mask, scale)
            t1 = time.perf_counter()
            timing["cpu_attention_compute_s"] += t1 - t0
            timing["cpu_attention_calls"] += 1
            box["o"] = io.stage(buf, o)
            self._cpu_free_at = time.perf_counter()
            timing["cpu_attention_stage_s"] += self._cpu_free_at - t1
            return DONE

        # the down and attention lanes: a call's input copies overlap the attention of the call
        # before it; `done` resolves once its output is staged
        self.cpu_attention_bytes += rows * (t + 1) * self.kv.codec.rec_bytes
        got = lanes.cpu_down.run(down, [lanes.compute.mark()] + free)
        done = lanes.cpu.run(attention, [got] + seg.track.claim())
        seg.track.wrote(done)
        seg.track.tag = t + 1
        io.free[buf] = [done]  # its q, k, v read (fetch adds the read of its output)
        return done, box

    def _prompt_logprobs(self, w: Mapping[str, Any], h: torch.Tensor, st: _Batch) -> torch.Tensor:
        """Log-probability of each prompt token given the ones before it: (n, S-1)."""
        n, S, _ = h.shape
        out = torch.zeros(n, max(S - 1, 0), dtype=torch.float32, device=h.device)
        chunk = max(1, (1 << 24) // max(1, n * self.spec.vocab_size))
        for c0 in range(0, S - 1, chunk):
            c1 = min(S - 1, c0 + chunk)
            logits = self.fam.head(w, h[:, c0:c1]).float()
            out[:, c0:c1] = logits.log_softmax(-1).gather(-1, st.ids[:, c0 + 1:c1 + 1, None])[..., 0]
        return out
