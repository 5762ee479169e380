"""The training step's cost model and search: the LP against brute force over placements, the
memory it plans against the engine's own plan, and the shape of what it picks."""

from __future__ import annotations

import itertools

import pytest
import torch

from flexoff.checkpoint import load_model
from flexoff.offload.adapters import Need
from flexoff.offload.engine import adapter_bytes
from flexoff.offload.layout import Layout, PlainFormat
from flexoff.offload.memory import plan_memory
from flexoff.policy.hardware import h200
from flexoff.policy.search import Budget, search_training, solve_lp
from flexoff.policy.train_cost import TrainChoice, TrainCostModel
from reference import lp_beats_grid

GiB = 2**30


def spec(name: str):
    return load_model(f"dummy:{name}").spec


def _points(step: float = 0.5):
    vals = [i * step for i in range(int(1 / step) + 1)]
    for wg, wc, hg, hc, sg, sc in itertools.product(vals, repeat=6):
        if wg + wc <= 1 and hg + hc <= 1 and sg + sc <= 1:
            yield {"wg": wg, "wc": wc, "wd": 1 - wg - wc, "cg": 0, "cc": 1, "cd": 0,
                   "hg": hg, "hc": hc, "hd": 1 - hg - hc, "sg": sg, "sc": sc, "sd": 1 - sg - sc}


@pytest.mark.parametrize("gbs,nb,apart,overlap", [(4, 2, "stash", True), (8, 1, "weights", False)])
def test_training_lp_optimum_is_never_worse_than_a_grid_point(gbs, nb, apart, overlap):
    model = TrainCostModel(spec("opt-6.7b"), h200(), 512, TrainChoice(gbs, nb, apart=apart, overlap=overlap))
    budget = Budget(12 * GiB, 64 * GiB, 1e12)
    x, latency = solve_lp(model, budget)
    assert model.evaluate(x).latency == pytest.approx(latency, rel=1e-6)
    assert lp_beats_grid(model, budget, _points(), latency) > 20


def test_training_memory_is_the_engines_plan():
    """What the LP plans for a rounded policy is what a training engine allocates for a rank-16
    adapter on every linear layer (within the engine's pinned bounce buffers, alignment, whole
    tensors staged, and the adapter's host copy)."""
    s = spec("opt-1.3b")
    layouts = [Layout(PlainFormat(torch.float16).fields(l)) for l in s.layers]
    budget = Budget(6 * GiB, 40 * GiB, 100 * GiB)
    widths = [s.lora_width(j) for j in range(len(s.layers))]
    need = Need(1, 16 * sum(widths), 16 * max(widths))  # one adapter of rank 16 on every linear layer
    for cand in search_training(s, h200(), 256, 8, budget)[:6] + search_training(s, h200(), 256, 8,
                                                                                   Budget(3 * GiB, 4 * GiB, 1e12))[:3]:
        p = cand.policy
        plan = plan_memory(s, layouts, s.kv_bytes_per_token(2), p, 256, 1, torch.float16, True, training=True,
                           adapters=adapter_bytes(need, 2 * need.elements, layouts, p, torch.float16),
                           trained=need.elements)
        for tier in ("gpu", "cpu", "disk"):
            want, got = plan.total(tier), cand.prediction.memory[tier]
            # the engine splits a layer's weights by whole tensors and stages them so: a tier may
            # hold up to a largest tensor per slot more or less than the LP's linear shares
            slack = 2 * s.largest_matmul_bytes(2) if p.w_gpu_percent < 100 else 0
            assert abs(want - got) <= 0.02 * want + 64 * 2**20 + slack, (p.describe(), tier, want, got)


def test_streamed_training_pays_two_weight_sweeps_and_resident_training_keeps_graphs():
    hw = h200()
    s = spec("opt-30b")
    best = search_training(s, hw, 512, 8, Budget(16 * GiB, 100 * GiB, 0))[0]
    p, pred = best.policy, best.prediction
    streamed = (100 - p.w_gpu_percent) / 100 * s.weight_bytes(2)  # bytes over the link, each sweep
    assert pred.prefill_s >= streamed / hw.ctog_bdw * 0.99 and pred.decode_s >= streamed / hw.ctog_bdw * 0.99
    assert p.w_gpu_percent < 30 and "ctog" in pred.bottleneck
    assert pred.throughput == pytest.approx(8 * 512 / pred.latency)

    llama = search_training(spec("llama-7b"), hw, 512, 8, Budget(80 * GiB, 100 * GiB, 0))[0]
    lp = llama.policy
    assert (lp.w_gpu_percent, lp.stash_gpu_percent) == (100, 100)  # the engine keeps graphs: no recompute
    assert (lp.gpu_batch_size, lp.num_gpu_batches) == (8, 1)  # one block of the micro-batch
    flops = 8 * 512 * sum(s2 for s2 in (spec("llama-7b").linear_flops(j) for j in range(len(spec("llama-7b").layers))))
    assert llama.prediction.latency >= 2 * flops / hw.mm_flops_p  # forward and input gradients at least


def test_no_training_policy_fits_is_a_clear_error():
    from flexoff.errors import MemoryBudgetError

    with pytest.raises(MemoryBudgetError, match="no training policy fits"):
        search_training(spec("opt-30b"), h200(), 2048, 8, Budget(0.5 * GiB, 100 * GiB, 0))
