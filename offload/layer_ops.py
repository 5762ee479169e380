"""Each layer kind's work on one step of a block: a forward and a backward.

Knows: for `embed`, `attn`, `mlp` and `head` layers (and a pipeline stage's `recv` and `send`),
what a forward step loads, computes and stores (FlexGen's loop: load weight, load cache, load
activation, compute, store activation, store cache), including decode attention on the CPU next
to a CPU-resident cache; what a backward step computes: the vector-Jacobian product of the
layer with respect to its input, recomputed inside the layer from its stashed input (nothing
else of the forward is kept), through frozen weights (no gradient is ever formed for a base weight).
Does not know: the order of steps (offload.schedule), where tensors live (the stores do).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from flexoff.kernels.attention import decode_attention
from flexoff.kernels.quant import fuses
from flexoff.models.attention import attend, attend_cached
from flexoff.models.base import materialize
from flexoff.offload.adapters import LoraLinear
from flexoff.offload.block import BlockRun, Pending, vjp
from flexoff.offload.lanes import DONE, Event
from flexoff.offload.schedule import Step

if TYPE_CHECKING:
    from flexoff.offload.engine import Engine

PREFILL_CHUNK = 8192  # prefill_chunk_tokens' default


@dataclass
class LeanStep:
    """A decode token step of one batch whose weights, cache and activations are all on the
    compute device (offload.lean): fixed shapes, positions as device tensors."""
    k: int  # GPU batch
    n: int  # its rows
    T: int  # cache positions attended over: the block's prompt and generated tokens
    ids: torch.Tensor  # (n, 1) the previous step's tokens
    pos: torch.Tensor  # (n, 1) their positions
    t: torch.Tensor  # (1,) int64: the new token's place in the cache
    mask: torch.Tensor  # (n, 1, T) bool: cache positions each row attends to
    adapters: torch.Tensor | None = None  # (n,) int32 adapter index per row (-1: none), if the pool serves it


def dense(w: Mapping[str, Any]) -> dict[str, Any]:
    """Weights that autograd can differentiate through: compressed ones dequantized; LoRA-wrapped
    ones keep their adapters, each adapter its rows use with A and B transposed as fresh leaves
    (the gradients asked for)."""
    out: dict[str, Any] = {}
    for n, v in w.items():
        if isinstance(v, LoraLinear):
            p = v.pack
            hid = v.host_ids if v.host_ids is not None else tuple(v.ids.tolist())
            used = sorted(a for a in set(hid) - {-1} if p.ranks[a])
            leaves = {a: tuple(t.detach().requires_grad_(True) for t in p.weights(a)) for a in used}
            out[n] = LoraLinear(materialize(v.base), v.ids, replace(p, leaves=leaves), v.host_ids)
        else:
            out[n] = materialize(v)
    return out


def lora_leaves(w: Mapping[str, Any]) -> list[tuple[str, int, tuple[torch.Tensor, torch.Tensor]]]:
    """The LoRA leaves dense() made: (tensor name, adapter's block index, (A, B transposed))."""
    return [(n, a, ab) for n, v in w.items() if isinstance(v, LoraLinear) for a, ab in v.pack.leaves.items()]


class LayerOp:
    """The steps of one layer j. Subclasses say what their compute is."""

    graphs = True  # a training window may keep this layer's autograd graph (engine.keep_graphs)
    whole_prompt = True  # a prefill step computes every prompt token (the head: each row's last)

    def __init__(self, engine: "Engine", j: int):
        self.e, self.j = engine, j

    # ---- shared plumbing -------------------------------------------------------------------
    def load(self, run: BlockRun, prev: Step, step: Step) -> None:
        """Start loading what `step` reads, while `prev` computes: its input (forward) or its
        stashed input (backward); attention adds its KV cache."""
        e = self.e
        if step.backward:
            if self.j >= 1 and e.stash.holds((self.j, step.k), step.i):  # not if `prev` stashes it
                e.stash.prefetch((self.j, step.k), step.i)
        elif step.j >= 1 and step.k != prev.k and e.hidden.holds(step.k, step.j - 1):
            # not for the same batch: its input is what `prev` produces
            e.hidden.prefetch(step.k, step.j)

    def load_cache(self, run: BlockRun, step: Step) -> bool:
        """Attention's: start loading a decode step's staged KV rows. Other layers read none."""
        return False

    def _inputs(self, run: BlockRun, step: Step) -> tuple[Mapping[str, Any], torch.Tensor]:
        """Layer j's weights and input for this batch, the compute stream waiting for both; in a
        training window the input is also stashed for the reverse sweep."""
        e = self.e
        w, deps = self._weights(run, step.k, step.i if self._shares_dequantized(run, step) else None)
        h, hdeps = e.hidden.take(step.k, self.j)
        e.lanes.compute.wait(deps + hdeps)
        if run.trains[step.k] and not (e.keep_graphs and self.graphs):  # kept past the hidden ring's reuse
            e.stash.put((self.j, step.k), e.hidden.owned(h), step.i, e.lanes.compute.mark())
        return w, h

    def _train(self, run: BlockRun, step: Step, w: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
        """A training window's forward: plain (the reverse sweep recomputes it from the stashed
        input) or, where the engine keeps graphs, recorded by autograd for the reverse sweep."""
        if not self.e.keep_graphs:
            return self.window(run, step, w, h)
        x = self.e.hidden.owned(h).detach().requires_grad_(True)  # the graph keeps it
        wd = dense(w)
        with torch.enable_grad():
            out = self.window(run, step, wd, x)
        run.graphs[(self.j, step.k)] = (out, x, lora_leaves(wd))
        return out.detach()

    def _output(self, step: Step, h: torch.Tensor) -> None:
        """Store this layer's output for the batch's next layer; the weights were read until now."""
        ev = self.e.lanes.compute.mark()
        self.e.weights.was_read(self.j, ev)
        self.e.hidden.put(step.k, self.j, h, ev)

    def _shares_dequantized(self, run: BlockRun, step: Step) -> bool:
        """Whether this step reads its layer's compressed weights dequantized once for all of the
        sweep's GPU batches: an inference step of a block of several batches whose matmuls
        would dequantize whole weights (not the fused kernel, which dequantizes in registers)."""
        if not self.e.policy.compress_weight or len(run.states) < 2 or run.trains[step.k]:
            return False
        st = run.states[step.k]
        return not fuses(st.n * (st.S if step.i == 0 and self.whole_prompt else 1), self.e.device)

    def _weights(self, run: BlockRun, k: int, sweep: int | None = None) -> tuple[Mapping[str, Any], list[Event]]:
        """Layer j's weights for batch k (with its rows' LoRA adapters), and what to wait for;
        with `sweep`, compressed ones dequantized once for that sweep's batches (the compute
        stream then waits for their load here)."""
        e = self.e
        e.stage(run, self.j)  # a no-op if staged already
        w, deps = e.weights.get(self.j)
        if sweep is not None:
            e.lanes.compute.wait(deps)
            w, deps = run.dequantized((sweep, self.j), w), []
        ba = run.adapters[k]
        if ba:
            w = e.adapters.adapt(self.j, w, ba.ids, ba.present, e.weights.slot_of(self.j), ba.host)
        return w, deps

    def forward(self, run: BlockRun, step: Step) -> None:
        w, h = self._inputs(run, step)
        self._output(step, self._train(run, step, w, h) if run.trains[step.k] else self.compute(run, step, w, h))

    def backward(self, run: BlockRun, step: Step) -> None:
        """run.grads[k] is d loss / d (this layer's output); leaves d loss / d (its input)."""
        e = self.e
        g = run.grads[step.k]
        if e.keep_graphs:  # the forward's graph: no weights, no recompute
            out, x, leaves = run.graphs.pop((self.j, step.k))
            with torch.enable_grad():
                got = torch.autograd.grad(out, [x, *(t for _, _, ab in leaves for t in ab)], g)
            run.grads[step.k], pgrads = got[0], list(got[1:])
        else:
            w, deps = self._weights(run, step.k)
            x, sdeps = e.stash.take((self.j, step.k), step.i)
            e.lanes.compute.wait(deps + sdeps)
            wd = dense(w)
            leaves = lora_leaves(wd)
            run.grads[step.k], pgrads = vjp(lambda h: self.window(run, step, wd, h), x, g,
                                            [t for _, _, ab in leaves for t in ab])
        block = e.adapters.block if leaves else []
        for (n, a, _), gA, gBt in zip(leaves, pgrads[0::2], pgrads[1::2]):
            acc = run.lora_grads.setdefault((self.j, n), {}).setdefault(
                block[a], [torch.zeros_like(gA), torch.zeros_like(gBt)])
            acc[0] += gA
            acc[1] += gBt
        if not e.keep_graphs:
            e.weights.was_read(self.j, e.lanes.compute.mark())

    def compute(self, run: BlockRun, step: Step, w: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
        return self.window(run, step, w, h)

    def window(self, run: BlockRun, step: Step, w: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
        """The layer over a whole window of tokens, no cache involved (training)."""
        raise NotImplementedError

    def lean(self, ls: LeanStep, h: torch.Tensor | None) -> torch.Tensor:
        """A resident decode step: the layer's output (the head's: logits (n, vocab))."""
        raise NotImplementedError

    def _lean_weights(self, ls: LeanStep) -> Mapping[str, Any]:
        """Resident weights; with adapters, every matmul some adapter adapts is wrapped, whatever
        the rows use now (a graph captured once then serves any mix of adapters)."""
        w = self.e.weights.get(self.j)[0]
        if ls.adapters is None:
            return w
        return self.e.adapters.adapt(self.j, w, ls.adapters, None)


class EmbedOp(LayerOp):
    def forward(self, run: BlockRun, step: Step) -> None:
        w, deps = self._weights(run, step.k)
        self.e.lanes.compute.wait(deps)
        st = run.states[step.k]
        if self.e.pipe is not None and step.i >= 1:  # the tokens come back from the pipeline's last stage
            self.e.pipe.recv_tokens(st.tokens[step.i - 1])
        ids, pos = st.inputs(step.i if not run.trains[step.k] else 0)
        self._output(step, self.e.fam.embed(w, ids, pos))

    def backward(self, run: BlockRun, step: Step) -> None:
        """The sweep's end: run.grads[k] stays d loss / d (the embedding's output)."""

    def lean(self, ls: LeanStep, h: torch.Tensor | None) -> torch.Tensor:
        return self.e.fam.embed(self.e.weights.get(self.j)[0], ls.ids, ls.pos)


def prefill_chunk_tokens() -> int:
    """Tokens a prefill's MLP, and its attention over a lossy cache's decoded keys and values,
    take at once at most (`FLEXOFF_PREFILL_CHUNK`, 0: all of a GPU batch's). Whole, a GPU batch
    of 48 prompts of 512 tokens of OPT-30B held a 1.3 GiB MLP intermediate and 0.66 GiB of
    decoded 4-bit keys and values per layer; at the --gpu-mem cap such allocations found no
    free block and had the CUDA allocator synchronize and release its cache first
    (benchmarks/RESULTS.md, 2026-11-27's twelfth session)."""
    return int(os.environ.get("FLEXOFF_PREFILL_CHUNK", PREFILL_CHUNK))


def chunk_rows(chunk: int, seq: int) -> int:
    """Sequences of `seq` tokens a chunk of `chunk` tokens holds (at least one; 0: no chunks)."""
    return max(1, chunk // max(1, seq)) if chunk else 1 << 62


def by_rows(like: torch.Tensor, rows: int, part: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """A tensor shaped as `like`, filled `rows` rows (dim 0) at a time: part(r0, r1) gives rows
    [r0, r1) (a prefill's transients held for a chunk of its sequences at a time)."""
    out = torch.empty_like(like)
    n = like.shape[0]
    for r0 in range(0, n, rows):
        out[r0:r0 + rows] = part(r0, min(n, r0 + rows))
    return out


class MlpOp(LayerOp):
    def window(self, run: BlockRun, step: Step, w: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
        """The MLP of whole sequences; in inference, over sequences of at most the engine's
        `chunk` tokens at a time where the weights are plain tensors (a compressed weight would
        be dequantized per chunk; LoRA rows are grouped for the whole batch)."""
        fam, rows = self.e.fam, chunk_rows(self.e.chunk, h.shape[1])
        if h.shape[0] <= rows or torch.is_grad_enabled() or not all(isinstance(v, torch.Tensor) for v in w.values()):
            return fam.mlp(w, h)
        return by_rows(h, rows, lambda r0, r1: fam.mlp(w, h[r0:r1]))

    def lean(self, ls: LeanStep, h: torch.Tensor | None) -> torch.Tensor:
        return self.e.fam.mlp(self._lean_weights(ls), h)


class HeadOp(LayerOp):
    whole_prompt = False
    graphs = False  # the loss task keeps what it needs; its backward reads the stashed input

    def forward(self, run: BlockRun, step: Step) -> None:
        e = self.e
        w, h = self._inputs(run, step)
        run.tasks[step.k].forward(e.fam, w, h, run.states[step.k], step.i)
        ev = e.lanes.compute.mark()
        e.weights.was_read(self.j, ev)
        e.hidden.read(step.k, ev)
        if e.pipe is not None and step.i < run.gen_len - 1:  # the first stage embeds them next
            e.pipe.send_tokens(run.states[step.k].tokens[step.i])

    def backward(self, run: BlockRun, step: Step) -> None:
        e = self.e
        w, deps = self._weights(run, step.k)
        x, sdeps = e.stash.take((self.j, step.k), step.i)
        e.lanes.compute.wait(deps + sdeps)
        run.grads[step.k] = run.tasks[step.k].backward(e.fam, dense(w), x, run.states[step.k])
        e.weights.was_read(self.j, e.lanes.compute.mark())

    def lean(self, ls: LeanStep, h: torch.Tensor | None) -> torch.Tensor:
        return self.e.fam.head(self.e.weights.get(self.j)[0], h)[:, 0]  # (n, vocab)


class AttnOp(LayerOp):
    def __init__(self, engine: "Engine", j: int):
        super().__init__(engine, j)
        self.li = engine.kv.layer_index[j]

    def load(self, run: BlockRun, prev: Step, step: Step) -> None:
        self.load_cache(run, step)
        super().load(run, prev, step)

    def load_cache(self, run: BlockRun, step: Step) -> bool:
        """Start loading the staged KV rows a decode step attends over (if not already loading);
        whether `step` is one that reads them."""
        if step.backward or step.i < 1 or run.trains[step.k]:
            return False
        st = run.states[step.k]
        self.e.kv.load(self.li, step.k, st.n, st.S + step.i - 1)
        return True

    def window(self, run: BlockRun, step: Step, w: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
        fam, st = self.e.fam, run.states[step.k]
        q, k, v = fam.attn_in(w, h, st.pos0)
        return fam.attn_out(w, h, attend(q, k, v, st.mask0, fam.scale))

    def lean(self, ls: LeanStep, h: torch.Tensor | None) -> torch.Tensor:
        e = self.e
        fam, codec, w = e.fam, e.kv.codec, self._lean_weights(ls)
        q, k, v = fam.attn_in(w, h, ls.pos)
        buf = e.kv.homes[self.li][ls.k]["gpu"].buf
        codec.write_at(buf, ls.n, ls.T, ls.t, k, v)
        return fam.attn_out(w, h, decode_attention(q, *codec.read(buf, ls.n, ls.T), ls.mask, fam.scale))

    def forward(self, run: BlockRun, step: Step) -> None:
        if step.i >= 1 and not run.trains[step.k]:  # a CPU attention call takes the next buffer set
            run.finish_where(lambda c: c.buffers == self.e.host_io.next)
        w, h = self._inputs(run, step)
        if run.trains[step.k]:
            self._output(step, self._train(run, step, w, h))
            return
        cont = self._attention(run, step, w, h)
        if cont is not None:
            run.pending.append(cont)

    def _attention(self, run: BlockRun, step: Step, w: Mapping[str, Any], h: torch.Tensor) -> Pending | None:
        e = self.e
        i, j, k = step.i, step.j, step.k
        st = run.states[k]
        fam, kv, li = e.fam, e.kv, self.li
        q, kk, vv = fam.attn_in(w, h, st.inputs(i)[1])
        if i == 0:  # prefill: store the keys, attend over them as stored (a lossy codec's values)
            read = kv.store_prompt(li, k, st.n, kk, vv)
            rows = chunk_rows(e.chunk, q.shape[2]) if kv.codec.lossy else st.n
            if rows >= st.n:
                o = attend(q, *read(0, st.n), st.mask0, fam.scale)
            else:  # a lossy codec's keys and values decoded a chunk of rows at a time
                o = by_rows(q, rows, lambda r0, r1: attend(q[r0:r1], *read(r0, r1), st.mask0[r0:r1], fam.scale))
            self._output(step, fam.attn_out(w, h, o))
            return None
        t = st.S + i - 1  # position of the new token
        mask = st.valid[:, None, :t + 1]
        outs: list[Any] = []
        cpu: tuple[Event, dict[str, Any]] | None = None
        for tier, r0, r1 in kv.segments(st.n):
            if tier == "cpu" and kv.cpu_compute:
                cpu = self._cpu_attention(run, k, q[r0:r1], kk[r0:r1], vv[r0:r1], r0, r1, t)
                outs.append(None)
                continue
            buf, deps = kv.device_buffer(li, k, st.n, tier, t)
            e.lanes.compute.wait(deps)
            kv.codec.write(buf, r1 - r0, t, kk[r0:r1], vv[r0:r1])
            K, V = kv.codec.read(buf, r1 - r0, t + 1)
            outs.append(decode_attention(q[r0:r1], K, V, mask[r0:r1], fam.scale))
            if tier != "gpu":
                kv.stored_new_token(li, k, tier, r1 - r0, t, e.lanes.compute.mark())
        kv.release(li, k)

        def finish() -> None:
            if cpu is not None:
                ev, box = cpu
                ev.wait_host()
                outs[outs.index(None)] = e.host_io.fetch(box["set"], box["o"])
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            self._output(step, fam.attn_out(w, h, o))

        if cpu is None:
            finish()
            return None
        return Pending(k, j, cpu[1]["set"], finish)

    def _cpu_attention(self, run: BlockRun, kb: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       r0: int, r1: int, t: int) -> tuple[Event, dict[str, Any]]:
        """Decode attention for CPU-resident rows on the CPU lane: an event for its output
        (rows, heads, 1, d), which is box["o"] once the event resolves (staged in buffer set
        box["set"], for host_io.fetch)."""
        e = self.e
        st = run.states[kb]
        seg, codec, io, kv = e.kv.homes[self.li][kb]["cpu"], e.kv.cpu_codec, e.host_io, e.kv
        rows, scale, timing = r1 - r0, e.fam.scale, e.timing
        mask = st.valid_host[r0:r1, None, :t + 1]
        cap = kv.split["cpu"]
        threads = e.cpu_threads
        lanes, buf, free = e.lanes, *io.take()
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
            if run.cpu_free_at is not None:  # the lane's idle time since its last call, by where
                timing["cpu_attention_idle_layer_s" if kb == 0 else "cpu_attention_idle_batch_s"] += \
                    t0 - run.cpu_free_at
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
            run.cpu_free_at = time.perf_counter()
            timing["cpu_attention_stage_s"] += run.cpu_free_at - t1
            return DONE

        # the down and attention lanes: a call's input copies overlap the attention of the call
        # before it; `done` resolves once its output is staged
        e.cpu_attention_bytes += rows * (t + 1) * kv.codec.rec_bytes
        got = lanes.cpu_down.run(down, [lanes.compute.mark()] + free)
        done = lanes.cpu.run(attention, [got] + seg.track.claim())
        seg.track.wrote(done)
        seg.track.tag = t + 1
        io.free[buf] = [done]  # its q, k, v read (fetch adds the read of its output)
        return done, box


class RecvOp(LayerOp):
    """A pipeline stage's input: the batch's hidden states from the stage before."""

    def forward(self, run: BlockRun, step: Step) -> None:
        e, st = self.e, run.states[step.k]
        shape = (st.n, st.S if step.i == 0 else 1, e.spec.hidden_size)
        self._output(step, e.pipe.recv_hidden(shape, e.dtype, e.device))


class SendOp(LayerOp):
    """A pipeline stage's output: the batch's hidden states go to the stage after."""

    def forward(self, run: BlockRun, step: Step) -> None:
        w, h = self._inputs(run, step)
        self.e.pipe.send_hidden(h)
        ev = self.e.lanes.compute.mark()
        self.e.weights.was_read(self.j, ev)
        self.e.hidden.read(step.k, ev)


OPS = {"embed": EmbedOp, "attn": AttnOp, "mlp": MlpOp, "head": HeadOp, "recv": RecvOp, "send": SendOp}


def layer_ops(engine: "Engine") -> list[LayerOp]:
    """One op per layer of the engine's model, by its kind."""
    return [OPS[layer.kind](engine, j) for j, layer in enumerate(engine.spec.layers)]
