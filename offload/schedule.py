"""FlexGen's zig-zag block schedule as one iterator.

Knows: the order in which (token step i, layer j, GPU batch k) squares are
computed, and what comes next (to prefetch) with the wrap-around from the
last batch to the next layer and from the last layer to the next token; and
one departure from it, for layers the caller names "early": in decode steps
the first batch of such a layer runs before the last batch of the layer before.
Does not know: what a square does.
"""

from __future__ import annotations

from typing import Collection, Iterator, NamedTuple


class Step(NamedTuple):
    i: int  # token step (0 is the prefill)
    j: int  # layer
    k: int  # GPU batch within the block


def zigzag(gen_len: int, num_layers: int, num_batches: int,
           early: Collection[int] = ()) -> Iterator[tuple[Step, Step | None]]:
    """Yield (step, next step or None at the end), token by token, layer by layer,
    batch by batch: the weights of layer j are loaded once per token for all batches.

    In decode steps (i >= 1) with two or more batches, layer j in `early` starts before
    layer j - 1 ends: (j, 0) comes just before (j - 1, last batch). Batch 0's input is ready
    by then, so work that waits on the last batch of layer j - 1 (CPU attention finishing,
    say) need not hold up the start of layer j."""
    K = num_batches
    prev: Step | None = None
    for i in range(gen_len):
        order = [Step(i, j, k) for j in range(num_layers) for k in range(K)]
        if i >= 1 and K >= 2:
            for j in sorted(early):
                if 1 <= j < num_layers:
                    a = j * K - 1  # (j - 1, K - 1), followed by (j, 0)
                    order[a], order[a + 1] = order[a + 1], order[a]
        for cur in order:
            if prev is not None:
                yield prev, cur
            prev = cur
    if prev is not None:
        yield prev, None
