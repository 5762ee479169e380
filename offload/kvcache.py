"""The KV cache: per attention layer and GPU batch, rows split across tiers.

Knows: the cache's byte layout (token-major: (tokens, rows, record), so a
prefix of tokens is one contiguous range and a new token is one contiguous
write, on every tier, disk included); the codec that turns keys and values
into records and back (plain here; quant/ adds a compressed one); GPU staging
slots that CPU or disk rows are loaded into for attention on the GPU; which
events each buffer's readers and writers wait for.
Does not know: model math (attention itself is flexoff.models.attention),
the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from flexoff.kernels.elementwise import store_token
from flexoff.models.spec import ModelSpec
from flexoff.offload.lanes import Event, Lanes, Tracked
from flexoff.offload.mover import Mover, Span, span_of
from flexoff.offload.placement import TIERS, row_segments, row_split
from flexoff.offload.tiers import Ledger
from flexoff.policy.policy import Policy, cache_slots


class KVCodec(Protocol):
    rec_bytes: int  # bytes of one token of one sequence (keys and values)
    lossy: bool  # a read returns other values than were written (quantized)

    def write(self, buf: torch.Tensor, rows: int, t: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def read(self, buf: torch.Tensor, rows: int, t: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def encode(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...


def records(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v (rows, kv_heads, s, head_dim) as one contiguous (s, rows, 2, kv_heads, head_dim) tensor,
    in one copy (stacking first and permuting after took two, the second a strided gather that
    took 5% of an OPT-30B compressed prefill's GPU time)."""
    return torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=2)


def wide(recs: torch.Tensor) -> torch.Tensor:
    """(s, rows, rec) record bytes viewed as the widest integers that divide a record."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if recs.shape[-1] % dt.itemsize == 0:
            return recs.view(dt)
    return recs


class PlainKV:
    """Keys and values stored as they are: a record is (2, kv_heads, head_dim) values."""

    lossy = False

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.kvh, self.hd, self.dtype = kv_heads, head_dim, dtype
        self.rec_bytes = 2 * kv_heads * head_dim * dtype.itemsize

    def _view(self, buf: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
        raw = buf[:tokens * rows * self.rec_bytes]
        return raw.view(self.dtype).view(tokens, rows, 2, self.kvh, self.hd)

    def write(self, buf: torch.Tensor, rows: int, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (rows, kv_heads, s, head_dim) at token positions t .. t + s."""
        x = self._view(buf, rows, t + k.shape[2])[t:]  # (s, rows, 2, kvh, d)
        x[:, :, 0] = k.permute(2, 0, 1, 3)
        x[:, :, 1] = v.permute(2, 0, 1, 3)

    def write_at(self, buf: torch.Tensor, rows: int, tokens: int, t: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Store one token's k, v (rows, kv_heads, 1, head_dim) at position t, a (1,) int64 tensor
        on the buffer's device (no host value: a CUDA graph replays it at every position), in a
        buffer laid out for `tokens` positions."""
        store_token(self._view(buf, rows, tokens), t, k, v)  # (tokens, rows, 2, kvh, d) at [t]

    def read(self, buf: torch.Tensor, rows: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens 0 .. t as strided (rows, kv_heads, t, head_dim) views."""
        x = self._view(buf, rows, t)
        return x[:, :, 0].permute(1, 2, 0, 3), x[:, :, 1].permute(1, 2, 0, 3)

    def encode(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Records of k, v (rows, kv_heads, s, head_dim) as contiguous (s, rows, rec) bytes (into
        `out` where given)."""
        x = records(k, v)
        recs = x.view(torch.uint8).view(x.shape[0], x.shape[1], self.rec_bytes)
        return recs if out is None else out.copy_(recs)


class HeadMajorKV:
    """Plain keys and values laid out for attention on the CPU, where each head's keys must be one
    contiguous matrix (a strided token-major read runs an order of magnitude slower in CPU
    matmuls). A prompt area holds the block's prompt keys then values, (rows, kv_heads, prompt,
    head_dim) each, packed at the start so the prefill stores them with one contiguous copy; a
    generated area after the largest prompt holds (rows, kv_heads, max_gen, head_dim) keys then
    values, one token written per step. Attention reads the two areas as two chunks."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, max_prompt: int, max_gen: int):
        self.kvh, self.hd, self.dtype = kv_heads, head_dim, dtype
        self.max_prompt, self.max_gen = max_prompt, max_gen
        self.rec_bytes = 2 * kv_heads * head_dim * dtype.itemsize

    def _x(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype)

    def prompt(self, buf: torch.Tensor, rows: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = rows * self.kvh * s * self.hd
        x = self._x(buf)[:2 * n].view(2, rows, self.kvh, s, self.hd)
        return x[0], x[1]

    def generated(self, buf: torch.Tensor, rows: int, cap_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, kv_heads, max_gen, head_dim) keys and values; the area starts after the largest
        prompt of the buffer's full row count."""
        start = 2 * cap_rows * self.kvh * self.max_prompt * self.hd
        n = rows * self.kvh * self.max_gen * self.hd
        x = self._x(buf)[start:start + 2 * n].view(2, rows, self.kvh, self.max_gen, self.hd)
        return x[0], x[1]


@dataclass
class _Seg:
    buf: Any  # uint8 tensor or DiskFile, capacity rows * max_tokens * rec bytes
    track: Tracked


def cached_batches(policy: Policy, windows: int | None) -> int:
    """The GPU batches of a block that have KV cache homes: all but a co-serving block's training
    windows (`windows` of them; None: any batch may train or generate), whose attention runs over
    their own window and keeps no cache."""
    return policy.num_gpu_batches - (windows or 0)


def kv_bytes(spec: ModelSpec, rec_bytes: int, policy: Policy, max_tokens: int,
             batches: int | None = None) -> dict[str, int]:
    """Bytes each tier holds for the KV cache of `batches` GPU batches (all of the policy's if
    None), GPU staging slots included."""
    batches = policy.num_gpu_batches if batches is None else batches
    split = row_split(policy.gpu_batch_size, policy.cache_gpu_percent, policy.cache_cpu_percent)
    per_row = max_tokens * rec_bytes * len(spec.attn_layers) * batches
    staged = split["disk"] + (0 if policy.cpu_cache_compute else split["cpu"])
    out = {t: split[t] * per_row for t in TIERS}
    out["gpu"] += cache_slots(policy.cpu_cache_compute, batches) * staged * max_tokens * rec_bytes
    return out


class KVStore:
    def __init__(self, spec: ModelSpec, codec: KVCodec, policy: Policy, mem: Ledger,
                 lanes: Lanes, mover: Mover, max_prompt: int, max_gen: int, batches: int | None = None):
        """Homes for the first `batches` GPU batches of a block (all if None; cached_batches)."""
        max_tokens = max_prompt + max_gen
        self.batches = policy.num_gpu_batches if batches is None else batches
        self.codec, self.lanes, self.mover = codec, lanes, mover
        self.max_tokens = max_tokens
        self.cpu_compute = policy.cpu_cache_compute
        self.split = row_split(policy.gpu_batch_size, policy.cache_gpu_percent, policy.cache_cpu_percent)
        self.layer_index = {j: li for li, j in enumerate(spec.attn_layers)}
        rec = codec.rec_bytes
        self.homes = [[{t: _Seg(mem.alloc(t, n * max_tokens * rec), Tracked())
                        for t, n in self.split.items() if n > 0}
                       for _ in range(self.batches)] for _ in spec.attn_layers]
        staged = {t: self.split[t] for t in self.staged_tiers() if self.split[t] > 0}
        n_slots = cache_slots(self.cpu_compute, self.batches)
        self.slots = [{t: _Seg(mem.alloc("gpu", n * max_tokens * rec), Tracked()) for t, n in staged.items()}
                      for _ in range(n_slots)] if staged else []
        # attention steps whose staged rows may load ahead of the step computing: all slots but its
        self.lookahead = n_slots - 1 if staged else 0
        # rows that CPU attention reads in place; a compressed cache keeps its records
        self.head_major = self.cpu_compute and isinstance(codec, PlainKV)
        self.cpu_codec: Any = HeadMajorKV(codec.kvh, codec.hd, codec.dtype, max_prompt, max_tokens - max_prompt) \
            if self.head_major else codec
        self._next_slot = 0
        self._staged: dict[tuple[int, int], int] = {}  # (attention layer, batch) -> slot

    def staged_tiers(self) -> tuple[str, ...]:
        """Tiers whose rows are loaded into a GPU slot for attention."""
        return ("disk",) if self.cpu_compute else ("cpu", "disk")

    def segments(self, n: int) -> list[tuple[str, int, int]]:
        return row_segments(n, self.split)

    def _bytes(self, rows: int, t0: int, t1: int) -> tuple[int, int]:
        rec = self.codec.rec_bytes
        return t0 * rows * rec, (t1 - t0) * rows * rec

    # ---- prefill -------------------------------------------------------
    def store_prompt(self, li: int, kb: int, n: int, k: torch.Tensor,
                     v: torch.Tensor) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """Store the prompt's keys and values (n, kv_heads, s, d), made on the compute stream,
        into every tier's rows, and return how to read rows [r0, r1) of them as a read of the
        cache would (a lossy codec's values, decoded from the records stored when read: the
        prompt is encoded once, and decoded a few rows at a time by a caller that wants less
        of it in device memory at once). A copy away from
        the GPU waits for an event marked after the records it copies are encoded (not merely
        after k and v exist: the encode is compute too, and a copy that starts before it ends
        reads unwritten memory)."""
        s, rec, segs = k.shape[2], self.codec.rec_bytes, self.segments(n)
        whole = None  # a lossy codec's records of all n rows, (s, n, rec), encoded once
        if self.codec.lossy:
            gpu_only = [tier for tier, _, _ in segs] == ["gpu"]
            home = self.homes[li][kb]["gpu"].buf[:s * n * rec].view(s, n, rec) if gpu_only else None
            whole = self.codec.encode(k, v, out=home)  # where the GPU holds them all, in place
        for tier, r0, r1 in segs:
            seg, rows = self.homes[li][kb][tier], r1 - r0
            # a tier's rows of the records: a strided copy, in words as wide as a record allows
            part = None if whole is None else wide(whole)[:, r0:r1]
            if tier == "gpu":
                if whole is None:
                    self.codec.write(seg.buf, rows, 0, k[r0:r1], v[r0:r1])
                elif not gpu_only:
                    wide(seg.buf[:s * rows * rec].view(s, rows, rec)).copy_(part)
                continue
            if part is not None:
                enc = part.contiguous()
            elif tier == "cpu" and self.head_major:  # the prompt area: keys then values, one copy
                enc = torch.stack((k[r0:r1], v[r0:r1])).contiguous()  # (2, rows, kv_heads, s, d)
            else:
                enc = self.codec.encode(k[r0:r1], v[r0:r1])  # (s, rows, rec), transient
            deps = [self.lanes.compute.mark()] + seg.track.claim()
            src = span_of(enc)
            cp = self.mover.copy(Span(seg.buf, 0, src.nbytes), src, deps, lane="store", transient=True)
            seg.track.wrote(cp)
            seg.track.tag = s  # tokens stored
        if whole is None:
            return lambda r0, r1: (k[r0:r1], v[r0:r1])
        return lambda r0, r1: self.codec.read(whole[:, r0:r1].contiguous().view(-1), r1 - r0, s)

    # ---- decode --------------------------------------------------------
    def load(self, li: int, kb: int, n: int, t: int) -> None:
        """Start loading tokens [0, t) of the staged rows of (layer, batch) into a GPU slot."""
        if (li, kb) in self._staged:
            return
        segs = [(tier, r0, r1) for tier, r0, r1 in self.segments(n) if tier in self.staged_tiers()]
        if not segs:
            return
        idx = self._next_slot  # a ring: loads are issued in the order the steps run
        self._next_slot = (idx + 1) % len(self.slots)
        for key in [key for key, i in self._staged.items() if i == idx]:
            del self._staged[key]
        self._staged[(li, kb)] = idx
        for tier, r0, r1 in segs:
            home, slot, rows = self.homes[li][kb][tier], self.slots[idx][tier], r1 - r0
            assert home.track.tag >= t, f"KV rows of layer {li} hold {home.track.tag} tokens, need {t}"
            off, nbytes = self._bytes(rows, 0, t)
            deps = slot.track.claim() + home.track.read_deps()
            ev = self.mover.copy(Span(slot.buf, 0, nbytes), Span(home.buf, off, nbytes), deps, lane="load")
            slot.track.wrote(ev)
            home.track.was_read(ev)

    def device_buffer(self, li: int, kb: int, n: int, tier: str, t: int) -> tuple[torch.Tensor, list[Event]]:
        """The GPU buffer attention reads for these rows (home or slot), and what to wait for."""
        if tier == "gpu":
            return self.homes[li][kb]["gpu"].buf, []
        if (li, kb) not in self._staged:
            self.load(li, kb, n, t)
        return self.slots[self._staged[(li, kb)]][tier].buf, self.slots[self._staged[(li, kb)]][tier].track.read_deps()

    def stored_new_token(self, li: int, kb: int, tier: str, rows: int, t: int, ev: Event) -> None:
        """Copy token t of staged rows from their slot back to their home; `ev` marks the
        compute that wrote it into the slot."""
        slot, home = self.slots[self._staged[(li, kb)]][tier], self.homes[li][kb][tier]
        slot.track.wrote(ev)
        off, nbytes = self._bytes(rows, t, t + 1)
        deps = slot.track.read_deps() + home.track.claim()
        cp = self.mover.copy(Span(home.buf, off, nbytes), Span(slot.buf, off, nbytes), deps, lane="store")
        home.track.wrote(cp)
        home.track.tag = t + 1
        slot.track.was_read(cp)

    def release(self, li: int, kb: int) -> None:
        """Forget which slot holds (layer, batch): the next decode step loads again."""
        self._staged.pop((li, kb), None)

    def reset(self) -> None:
        """Forget staged loads at the end of a block (a new block refills every row)."""
        self._staged.clear()
