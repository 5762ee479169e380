"""A block's work as data: the steps of FlexGen's zig-zag schedule, forward and reverse.

Knows: the order in which (sweep i, layer j, GPU batch k) squares are computed (a sweep
runs all of a block's batches, or one group of them where the block's batches go through a
token step in groups, as pipeline stages need), in forward sweeps (layers 0 .. L-1: a token step of inference, a training window's
forward) and reverse sweeps (layers L-1 .. 0: a training window's backward); what
comes next (whose KV cache and input to load) with the wrap-around from the last
batch to the next layer and from a sweep's last layer to the next sweep; which
layers' weights to start loading at each step (the next ones in the order the
schedule itself will need them, so a reverse sweep prefetches downwards); and one
departure from the zig-zag, for layers the caller names "early": in decode steps
the first batch of such a layer runs before the last batch of the layer before.
Does not know: what a square does (each layer kind's forward and backward do).
"""

from __future__ import annotations

from typing import Collection, Iterator, NamedTuple, Sequence


class Step(NamedTuple):
    i: int  # sweep: token step (0 is the prefill) or training window
    j: int  # layer
    k: int  # GPU batch within the block
    backward: bool = False  # a reverse sweep's step (vector-Jacobian product) or a forward one


class Sweep(NamedTuple):
    i: int  # token step or window
    backward: bool = False
    batches: tuple[int, ...] | None = None  # the GPU batches it runs (None: all of the block's)


class Plan(NamedTuple):
    """One step of a block and what to issue with it."""

    step: Step
    next: Step | None  # the step after it (its KV cache and input are loaded now); None at the end
    stage: tuple[int, ...]  # layers whose weights start loading now, in the order they will be needed
    ends: bool  # the last step of its token step (or window's sweep): every group of batches ran it
    upcoming: tuple[Step, ...] = ()  # the steps after it in its sweep, `lookahead` at most, next first


def forward_sweeps(gen_len: int, groups: Sequence[tuple[int, ...]] | None = None) -> list[Sweep]:
    """Inference: one forward sweep per token step, or one per group of batches where the block's
    batches go through the step in groups (pipeline stages: offload.pipeline)."""
    if groups is None:
        return [Sweep(i) for i in range(gen_len)]
    return [Sweep(i, False, g) for i in range(gen_len) for g in groups]


def training_sweeps(windows: int) -> list[Sweep]:
    """Training: each window's forward sweep, then its reverse sweep."""
    return [s for w in range(windows) for s in (Sweep(w), Sweep(w, True))]


def block_plan(sweeps: Sequence[Sweep], num_layers: int, num_batches: int, *, early: Collection[int] = (),
               ahead: int = 1, at: int = 0, lookahead: int = 1) -> Iterator[Plan]:
    """The block's steps, sweep by sweep, layer by layer, batch by batch: the weights of layer j
    are loaded once per sweep for all batches. At batch `at` of each layer, the weights of the
    `ahead` layers that come next in the schedule (into the next sweep too) start loading. Each
    plan lists up to `lookahead` steps that follow it in the same sweep (a step of the next sweep
    may read what this one writes, a KV cache row's new token say, so none is listed).

    In decode steps (forward sweeps i >= 1) with two or more batches, layer j in `early` starts
    before layer j - 1 ends: (j, 0) comes just before (j - 1, last batch). Batch 0's input is
    ready by then, so work that waits on the last batch of layer j - 1 (CPU attention
    finishing, say) need not hold up the start of layer j."""
    L = num_layers
    layers = [j for s in sweeps for j in _layers(s, L)]  # the block's layers in the order they run
    batches = [s.batches if s.batches is not None else tuple(range(num_batches)) for s in sweeps]
    steps = [(n, st) for n, s in enumerate(sweeps) for st in _order(s, L, batches[n], early)]
    for m, (n, st) in enumerate(steps):
        pos = n * L + (L - 1 - st.j if st.backward else st.j)  # this layer's place in `layers`
        ks = batches[n]
        stage = tuple(layers[pos + 1:pos + 1 + ahead]) if st.k == ks[min(at, len(ks) - 1)] else ()
        nxt = steps[m + 1][1] if m + 1 < len(steps) else None
        ends = nxt is None or (nxt.i, nxt.backward) != (st.i, st.backward)
        upcoming = tuple(u for _, u in steps[m + 1:m + 1 + lookahead] if (u.i, u.backward) == (st.i, st.backward))
        yield Plan(st, nxt, stage, ends, upcoming)



def _layers(sweep: Sweep, num_layers: int) -> range:
    return range(num_layers - 1, -1, -1) if sweep.backward else range(num_layers)


def _order(sweep: Sweep, num_layers: int, batches: tuple[int, ...], early: Collection[int]) -> list[Step]:
    order = [Step(sweep.i, j, k, sweep.backward) for j in _layers(sweep, num_layers) for k in batches]
    K = len(batches)
    if not sweep.backward and sweep.i >= 1 and K >= 2:
        for j in sorted(early):
            if 1 <= j < num_layers:
                a = j * K - 1  # (j - 1, its last batch), followed by (j, its first)
                order[a], order[a + 1] = order[a + 1], order[a]
    return order

