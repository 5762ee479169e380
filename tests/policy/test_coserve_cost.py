"""The co-served block's cost model and joint search: the LP against brute force over placements,
the block's time against inference and training priced apart, the memory against the engine's own
plan, and what the search picks under an inference-slowdown bound."""

from __future__ import annotations

import itertools

import pytest
import torch

from flexoff.checkpoint import load_model
from flexoff.offload.adapters import Need
from flexoff.offload.engine import adapter_bytes
from flexoff.offload.layout import Layout, PlainFormat
from flexoff.offload.memory import plan_memory
from flexoff.policy.coserve_cost import CoServeCostModel, search_coserve
from flexoff.policy.cost_model import Choice, CostModel, Workload
from flexoff.policy.hardware import h200
from flexoff.policy.search import Budget, search, solve_lp
from flexoff.policy.train_cost import TrainChoice, TrainCostModel
from reference import lp_beats_grid

GiB = 2**30
HW = h200()


def spec(name: str):
    return load_model(f"dummy:{name}").spec


def _points(step: float = 0.5):
    vals = [i * step for i in range(int(1 / step) + 1)]
    for wg, wc, cg, cc, hg, hc, sg, sc in itertools.product(vals, repeat=8):
        if wg + wc <= 1 and cg + cc <= 1 and hg + hc <= 1 and sg + sc <= 1:
            yield {"wg": wg, "wc": wc, "wd": 1 - wg - wc, "cg": cg, "cc": cc, "cd": 1 - cg - cc,
                   "hg": hg, "hc": hc, "hd": 1 - hg - hc, "sg": sg, "sc": sc, "sd": 1 - sg - sc}


@pytest.mark.parametrize("gbs,nb,windows,cpu_attn", [(8, 3, 1, False), (16, 2, 2, True)])
def test_coserve_lp_optimum_is_never_worse_than_a_grid_point(gbs, nb, windows, cpu_attn):
    model = CoServeCostModel(spec("opt-6.7b"), HW, Workload(256, 16), Choice(gbs, nb, cpu_cache_compute=cpu_attn),
                             windows, 384, rows=4)
    budget = Budget(10 * GiB, 48 * GiB, 1e12)
    x, latency = solve_lp(model, budget)
    assert model.evaluate(x).latency == pytest.approx(latency, rel=1e-6)
    assert lp_beats_grid(model, budget, _points(), latency) > 50


@pytest.mark.parametrize("overlap", [True, False])
def test_a_coserved_block_costs_between_inference_alone_and_both_apart(overlap):
    """Windows riding on a block share its prefill's weight loads: the block takes at least what
    its inference alone takes plus the windows' reverse sweep's weight staging, and at most what
    inference and the windows' own training block take one after the other."""
    s = spec("opt-6.7b")
    work, S, rows = Workload(256, 16), 384, 4
    for gbs, nb, w in [(8, 3, 1), (16, 2, 2), (4, 6, 3)]:
        ch = Choice(gbs, nb, overlap=overlap)
        co = CoServeCostModel(s, HW, work, ch, w, S, rows=rows)
        alone = CostModel(s, HW, Workload(S, 16), ch)  # prompts padded to the windows' length
        train = TrainCostModel(s, HW, S, TrainChoice(rows, w, overlap=overlap))
        for x in list(_points(1.0))[::7]:
            got = co.evaluate(x).latency
            streamed = (x["wc"] + x["wd"]) * s.weight_bytes(2) / HW.ctog_bdw
            assert got >= alone.evaluate(x).latency + streamed * 0.999
            assert got <= (alone.evaluate(x).latency + train.evaluate(x).latency) * (1 + 1e-9)


def test_coserve_memory_is_the_engines_plan():
    """What the co-served LP plans for a rounded policy is what the engine allocates for a block
    with that many training windows and a rank-16 adapter on every linear layer (within whole
    tensors staged, alignment and the adapter's host copy)."""
    s = spec("opt-1.3b")
    layouts = [Layout(PlainFormat(torch.float16).fields(l)) for l in s.layers]
    widths = [s.lora_width(j) for j in range(len(s.layers))]
    need = Need(1, 16 * sum(widths), 16 * max(widths))
    work = Workload(192, 16, 2, 64)
    checked = 0
    for budget in (Budget(6 * GiB, 40 * GiB, 100 * GiB), Budget(3 * GiB, 6 * GiB, 1e12)):
        for plan in search_coserve(s, HW, work, budget, 256, window_rows=8, max_windows=2, limit=0.5)[:5]:
            p = plan.policy
            mem = plan_memory(s, layouts, s.kv_bytes_per_token(2), p, 256, 16, torch.float16, True, training=True,
                              adapters=adapter_bytes(need, 2 * need.elements, layouts, p, torch.float16),
                              trained=need.elements, windows=plan.windows)
            for tier in ("gpu", "cpu", "disk"):
                want, got = mem.total(tier), plan.prediction.memory[tier]
                slack = 2 * s.largest_matmul_bytes(2) if p.w_gpu_percent < 100 else 0
                assert abs(want - got) <= 0.02 * want + 64 * 2**20 + slack, (p.describe(), tier, want, got)
            checked += 1
    assert checked >= 4


def test_the_search_keeps_inference_within_the_bound_and_trains_more_under_a_looser_one():
    s, work = spec("opt-30b"), Workload(512, 32)
    budget = Budget(16 * GiB, 100 * GiB, 0)
    best = search(s, HW, work, budget)[0].prediction.throughput
    got = {}
    # a block that takes windows of 8 rows runs its inference in small GPU batches, whose CPU
    # attention calls cost CPU_ATTN_CALL_S each: such plans keep less than inference alone
    for limit in (0.4, 0.6, 0.7):
        top = search_coserve(s, HW, work, budget, 512, window_rows=8, limit=limit, max_windows=4)[0]
        assert top.standalone_tps == pytest.approx(best)
        assert top.training_tps > 0 and top.inference_tps >= (1 - limit) * best * (1 - 1e-6), top.describe()
        assert 0 < top.share <= 1 and top.runtime_limit == pytest.approx(top.share * top.block_slowdown)
        got[limit] = top.training_tps
    assert got[0.4] <= got[0.6] <= got[0.7] and got[0.4] < got[0.7]
    tight = search_coserve(s, HW, work, budget, 512, window_rows=8, limit=0.05, max_windows=4)[0]
    assert tight.share == 0 and tight.training_tps == 0 and "inference runs alone" in tight.describe()
    free = search_coserve(s, HW, work, budget, 512, window_rows=8, max_windows=2)
    assert all(p.share == 1 and p.windows <= 2 for p in free)
    assert free[0].inference_tps == max(p.inference_tps for p in free)  # without a bound: inference first
