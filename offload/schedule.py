"""FlexGen's zig-zag block schedule as one iterator.

Knows: the order in which (token step i, layer j, GPU batch k) squares are
computed, and what comes next (to prefetch) with the wrap-around from the
last batch to the next layer and from the last layer to the next token.
Does not know: what a square does.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple


class Step(NamedTuple):
    i: int  # token step (0 is the prefill)
    j: int  # layer
    k: int  # GPU batch within the block


def zigzag(gen_len: int, num_layers: int, num_batches: int) -> Iterator[tuple[Step, Step | None]]:
    """Yield (step, next step or None at the end), token by token, layer by layer,
    batch by batch: the weights of layer j are loaded once per token for all batches."""
    prev: Step | None = None
    for i in range(gen_len):
        for j in range(num_layers):
            for k in range(num_batches):
                cur = Step(i, j, k)
                if prev is not None:
                    yield prev, cur
                prev = cur
    if prev is not None:
        yield prev, None
