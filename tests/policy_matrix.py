"""The engine's policy matrix: placements x batch shapes x overlap x CPU attention."""

from __future__ import annotations

import itertools

from flexoff import Policy

WEIGHTS = [(100, 0), (0, 100), (30, 40), (0, 0)]
PLACES = {"device": (100, 0), "cpu": (0, 100), "disk": (0, 0), "split": (30, 40)}
SHAPES = [(1, 1), (2, 3), (4, 2)]


def policy(w, place, shape, overlap, cpu_attn) -> Policy:
    (cg, cc), (gbs, nb) = PLACES[place], shape
    return Policy(gpu_batch_size=gbs, num_gpu_batches=nb, w_gpu_percent=w[0], w_cpu_percent=w[1],
                  cache_gpu_percent=cg, cache_cpu_percent=cc, act_gpu_percent=cg, act_cpu_percent=cc,
                  overlap=overlap, cpu_cache_compute=cpu_attn)


FULL = [policy(*combo) for combo in itertools.product(WEIGHTS, PLACES, SHAPES, (True, False), (True, False))]


def pairwise() -> list[Policy]:
    """A covering subset: every value of each dimension, and every pair of placement values."""
    out = []
    for n, (w, place) in enumerate(itertools.product(WEIGHTS, PLACES)):
        out.append(policy(w, place, SHAPES[n % 3], n % 2 == 0, (n // 2) % 2 == 0))
    return out
