"""Policy search: FlexGen's two-level search (§4.3).

Knows: the outer enumeration of batch shapes (gpu_batch_size, num_gpu_batches),
compression and CPU-attention choices; for each, the LP over the nine placement
fractions (PuLP with its bundled CBC) that minimizes block latency per sequence
under the cost model's memory constraints (and an optional latency bound);
rounding the LP solution to a runnable Policy (whole rows of cache and
activations, weight percentages to a tenth); ranking by predicted job
throughput.
Does not know: the engine (flexoff.autopolicy re-checks the winner against the
engine's own memory accounting).
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Iterable, Literal, Mapping

import pulp

from flexoff.errors import MemoryBudgetError
from flexoff.models.spec import ModelSpec
from flexoff.policy.cost_model import Choice, CostModel, Prediction, Workload, lora_cache_options
from flexoff.policy.hardware import Hardware
from flexoff.policy.policy import Policy
from flexoff.policy.train_cost import TrainChoice, TrainCostModel

GPU_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256)
NUM_GPU_BATCHES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)
Toggle = Literal["off", "on", "auto"]


@dataclass
class Candidate:
    policy: Policy
    prediction: Prediction
    fractions: dict[str, float] | None = None  # the placement the prediction is for (the rounded policy's)


@dataclass(frozen=True)
class Budget:
    gpu: float
    cpu: float
    disk: float

    @classmethod
    def of(cls, hw: Hardware, gpu: float | None = None, cpu: float | None = None,
           disk: float | None = None) -> "Budget":
        """The hardware's memory, lowered by any user budget."""
        pick = lambda have, cap: have if cap is None else min(have, cap)  # noqa: E731
        return cls(pick(hw.gpu_mem, gpu), pick(hw.cpu_mem, cpu), pick(hw.disk_mem, disk))


def _choices(toggle: Toggle) -> tuple[bool, ...]:
    return {"off": (False,), "on": (True,), "auto": (False, True)}[toggle]


TRANSFERS = ("ctog", "gtoc", "dtoc", "ctod")


def solve_lp(model: CostModel, budget: Budget, max_latency: float | None = None,
             least_traffic: bool = False, fixed: Mapping[str, float] | None = None
             ) -> tuple[dict[str, float], float] | None:
    """The placement that minimizes block latency T (the objective is T / bls, the same
    argmin for a fixed shape), and T; or None if nothing fits.

    least_traffic: among placements with T within max_latency, the one that moves the
    fewest bytes (used to break ties of the first solve deterministically).
    fixed: fractions held at these values (whole rows the search rounded to)."""
    prob = pulp.LpProblem("flexoff_policy", pulp.LpMinimize)
    x = {v: _var(prob, v, 1) for v in model.vars}
    for v, value in (fixed or {}).items():
        prob += x[v] == value, f"fixed_{v}"
    for tier_vars in zip(model.vars[0::3], model.vars[1::3], model.vars[2::3]):  # (g, c, d) of each kind
        prob += pulp.lpSum(x[v] for v in tier_vars) == 1
    for v, (lo, hi) in model.bounds().items():
        prob += x[v] >= lo, f"low_{v}"
        prob += x[v] <= hi, f"high_{v}"
    # times in units of the block's latency with everything on the GPU, so that the solver's
    # tolerances mean the same for a tiny model as for a large one
    unit = max(model.evaluate({v: float(v.endswith("g")) for v in model.vars}).latency, 1e-12)
    latency, traffic, T = model.lora_read_s / unit, 0, {}
    all_terms = model.terms(x)
    for (stage, kind), terms in all_terms.items():
        t = T[(stage, kind)] = _var(prob, f"T_{stage}_{kind}", None)
        if model.ch.overlap:
            for name, expr in terms.items():
                prob += t >= expr * (1 / unit), f"{stage}_{kind}_{name}"
        else:
            prob += t >= pulp.lpSum(terms.values()) * (1 / unit), f"{stage}_{kind}_serial"
        steps = model.count[kind] * model.sweep_count(stage)
        latency += steps * t
        traffic += steps * pulp.lpSum(terms[k] for k in TRANSFERS) * (1 / unit)
    pairs = model.count["attn"] * model.sweep_count("g")
    for name, expr in model.cache_pool(x, all_terms).items():  # what an (attn, mlp) pair shares
        prob += T[("g", "attn")] + T[("g", "mlp")] >= expr * (1 / unit), f"g_pair_{name}"
    traffic += pairs * model.pooled_traffic(x) * (1 / unit)
    prob += (traffic if least_traffic else latency) + model.preference(x)
    for tier, expr in model.memory(x).items():
        prob += expr <= getattr(budget, tier), f"mem_{tier}"
    for name, expr in model.constraints(x).items():
        prob += expr <= 0, f"con_{name}"
    if max_latency is not None:
        prob += latency <= max_latency / unit
    with warnings.catch_warnings():  # PuLP 3.x announces 4.0's API changes; its bundled CBC is what we use
        warnings.simplefilter("ignore", DeprecationWarning)
        prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[prob.status] != "Optimal":
        return None
    return {v: min(1.0, max(0.0, x[v].value() or 0.0)) for v in model.vars}, float(pulp.value(latency)) * unit


def _var(prob: pulp.LpProblem, name: str, upper: float | None) -> pulp.LpVariable:
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3
        return prob.add_variable(name, 0, upper)
    return pulp.LpVariable(name, 0, upper)


def round_policy(x: dict[str, float], ch: Choice,
                 up: Mapping[str, tuple[int, int]] | None = None) -> tuple[Policy, dict[str, float]]:
    """A runnable Policy near the LP solution (GPU shares rounded down), and its fractions; a
    training LP's stash fractions (sg, sc, sd) too. Rows of a GPU batch are whole: by default a
    tier's row counts (GPU, then GPU and CPU) round down; `up` rounds them up instead where it
    says so, per tier prefix ("c" cache, "h" activations): (GPU rows, GPU and CPU rows)."""
    gbs, eps = ch.gpu_batch_size, 1e-6
    wg = math.floor(x["wg"] * 1000 + eps) / 1000
    wgc = 1.0 if x["wd"] < 1e-4 else math.floor((x["wg"] + x["wc"]) * 1000 + eps) / 1000

    def rows(g: float, c: float, d: float, bump: tuple[int, int] = (0, 0)) -> tuple[float, float]:
        ng = min(gbs, math.floor(g * gbs + eps) + bump[0])
        ngc = gbs if d < eps else min(gbs, max(ng, math.floor((g + c) * gbs + eps) + bump[1]))
        return ng / gbs, (ngc - ng) / gbs

    up = up or {}
    cg, cc = rows(x["cg"], x["cc"], x["cd"], up.get("c", (0, 0)))
    hg, hc = rows(x["hg"], x["hc"], x["hd"], up.get("h", (0, 0)))
    frac = {"wg": wg, "wc": wgc - wg, "wd": 1 - wgc, "cg": cg, "cc": cc, "cd": 1 - cg - cc,
            "hg": hg, "hc": hc, "hd": 1 - hg - hc}
    stash = {}
    if "sg" in x:
        sg, sc = rows(x["sg"], x["sc"], x["sd"])
        frac.update(sg=sg, sc=sc, sd=1 - sg - sc)
        stash = {"stash_gpu_percent": sg * 100, "stash_cpu_percent": sc * 100}
    p = Policy(gbs, ch.num_gpu_batches, round(wg * 100, 1), round((wgc - wg) * 100, 1),
               cg * 100, cc * 100, hg * 100, hc * 100, ch.compress_weight, ch.compress_cache,
               ch.cpu_cache_compute and cc > 0, ch.overlap, ch.quant_bits, ch.quant_group, **stash,
               lora_cache_blocks=ch.lora_cache_blocks)
    return p, frac


def _fits(mem: dict[str, float], budget: Budget) -> bool:
    return all(mem[t] <= getattr(budget, t) * (1 + 1e-9) for t in ("gpu", "cpu", "disk"))


def default_shapes(num_prompts: int | None, stages: int = 1) -> list[tuple[int, int]]:
    """The (GPU batch size, GPU batches) the search tries: no more rows per batch than prompts,
    a block under twice the prompts. `stages`: a pipeline stage's engine holds one block per
    stage, so its shape has `stages` times the batches."""
    cap = num_prompts or 1 << 30
    return [(g, b * stages) for g, b in itertools.product(GPU_BATCH_SIZES, NUM_GPU_BATCHES)
            if g <= cap and g * b < 2 * cap]


def search(spec: ModelSpec, hw: Hardware, work: Workload, budget: Budget, *,
           compress_weight: Toggle = "off", compress_cache: Toggle = "off",
           cpu_attention: Toggle = "auto", overlap: bool = True,
           max_latency: float | None = None, objective: str = "throughput",
           shapes: Iterable[tuple[int, int]] | None = None, no_disk: bool = False) -> list[Candidate]:
    """All runnable candidates, best first. Raises MemoryBudgetError if none fits."""
    if no_disk:
        budget = Budget(budget.gpu, budget.cpu, 0.0)
    if shapes is None:
        shapes = default_shapes(work.num_prompts)
    out = []
    L = sum(1 for l in spec.layers if l.kind == "attn")
    total = budget.gpu + budget.cpu + budget.disk
    seen = set()
    # where the profile measured the page cache's read rate, each shape also with the disk tier
    # read from the page cache, its placements leaving the page cache room for it
    disk_models = (True, False) if hw.page_cache_faster() and budget.disk > 0 else (False,)
    for (gbs, nb), cw, cc, ca, cached in itertools.product(shapes, _choices(compress_weight), _choices(compress_cache),
                                                          _choices(cpu_attention), disk_models):
        for blocks in lora_cache_options(work, gbs * nb):  # host memory for the adapters read from files
            ch = Choice(gbs, nb, cw, cc, ca, overlap, lora_cache_blocks=blocks)
            model = CostModel(spec, hw, work, ch, cached_disk=cached)
            if model.kv * ch.bls * (work.prompt_len + work.gen_len) * L > total:
                continue  # the cache alone fits nowhere
            sol = solve_lp(model, budget, max_latency)
            if sol is None:
                continue
            cand = _candidate(model, sol[0], budget, max_latency)
            if cand is not None and cand.policy not in seen:
                seen.add(cand.policy)
                out.append((cand, model, sol[1]))
    if not out:
        raise MemoryBudgetError(_infeasible_message(spec, hw, work, budget, compress_weight, compress_cache))
    key = (lambda c: -c.prediction.throughput) if objective == "throughput" else (lambda c: c.prediction.latency)
    out.sort(key=lambda t: key(t[0]))
    ranked = []
    for n, (cand, model, best) in enumerate(out):
        if n < REFINE:  # the same latency with the least traffic: a deterministic choice among ties
            sol = solve_lp(model, budget, best * (1 + 1e-6), least_traffic=True)
            tied = _candidate(model, sol[0], budget, max_latency) if sol else None
            if tied is not None and key(tied) <= key(cand) + 1e-9 * abs(key(cand)) and tied.policy not in seen:
                cand = tied
        ranked.append(cand)
    return sorted(ranked, key=key)


REFINE = 8  # top candidates whose ties are broken by a second LP


BUMPS = ((0, 0), (0, 1), (1, 0), (1, 1))  # a tier's row counts rounded down, or one up


def _candidate(model: CostModel, x: dict[str, float], budget: Budget, max_latency: float | None) -> Candidate | None:
    """The best runnable rounding of the LP's fractions: cache and activation rows rounded down,
    or up by a row where that is faster and fits (a fraction of a row on disk, rounded to a whole
    one, can cost more than the row is worth). Where no rounding fits as it stands, each with
    the weights placed again around its whole rows (_weights_around)."""
    x = _fit_slots(model, x, budget)
    roundings = [round_policy(x, model.ch, {"c": cu, "h": hu}) for cu, hu in itertools.product(BUMPS, BUMPS)]
    best = _best(model, roundings, budget, max_latency)
    if best is None:
        distinct = {tuple(_rows(model, frac).values()): frac for _, frac in roundings}
        best = _best(model, [r for frac in distinct.values() if (r := _weights_around(model, frac, budget, max_latency))],
                     budget, max_latency)
    return best


def _best(model: CostModel, roundings: Iterable[tuple[Policy, dict[str, float]]], budget: Budget,
          max_latency: float | None) -> Candidate | None:
    """The fastest of the placements that fit the budget and the latency bound (the first of ties)."""
    best = None
    for policy, frac in roundings:
        pred = model.price(frac)
        if not _fits(pred.memory, budget) or not model.holds(frac) \
                or (max_latency is not None and pred.latency > max_latency * 1.001):
            continue
        if best is None or pred.latency < best.prediction.latency * (1 - 1e-9):
            best = Candidate(policy, pred, frac)
    return best


def _infeasible_message(spec: ModelSpec, hw: Hardware, work: Workload, budget: Budget,
                        compress_weight: Toggle, compress_cache: Toggle) -> str:
    """What would fit: the smallest budgets of the smallest runnable policy (batch 1, all on disk
    but the GPU's working set)."""
    compression = "off" if compress_weight == compress_cache == "off" else "on"
    model = CostModel(spec, hw, work, Choice(1, 1, compress_weight != "off", compress_cache != "off", False))
    need = model.memory({"wg": 0, "wc": 0, "wd": 1, "cg": 0, "cc": 0, "cd": 1, "hg": 1, "hc": 0, "hd": 0})
    gib = 2**30
    return (f"no policy fits: even a batch of one with everything on disk needs {need['gpu'] / gib:.2f} GiB "
            f"of GPU memory and {need['disk'] / gib:.2f} GiB of disk (have {budget.gpu / gib:.2f} GiB GPU, "
            f"{budget.cpu / gib:.2f} GiB CPU, {budget.disk / gib:.2f} GiB disk); raise the budgets"
            + (" or allow compression" if compression == "off" else ""))


def search_training(spec: ModelSpec, hw: Hardware, seq_len: int, batch: int, budget: Budget, *,
                    lora_rank: float = 16, compress_weight: Toggle = "off", overlap: bool = True,
                    shapes: Iterable[tuple[int, int]] | None = None, elem_bytes: int = 2) -> list[Candidate]:
    """Training policies for micro-batches of `batch` sequences of up to `seq_len` tokens, best
    first: each block shape (no more rows than the micro-batch), base weights 16- or 4-bit, the
    forward's graphs kept or recomputed, with the LP's placement of weights, stash and hidden
    states. Ranked by training tokens per second of a micro-batch, which runs in
    ceil(batch / block size) blocks of two weight sweeps each. Raises MemoryBudgetError if none fits."""
    if shapes is None:
        shapes = [(g, b) for g, b in itertools.product(GPU_BATCH_SIZES, NUM_GPU_BATCHES) if g * b <= batch]
        shapes += [(batch, 1)] if batch not in GPU_BATCH_SIZES else []
    out, seen = [], set()
    modes = ((True, "stash"), (False, "stash"), (False, "weights"))  # graphs kept; else what is apart
    for (gbs, nb), cw, (keep, apart) in itertools.product(shapes, _choices(compress_weight), modes):
        model = TrainCostModel(spec, hw, seq_len, TrainChoice(gbs, nb, cw, overlap=overlap, keep_graphs=keep,
                                                                  apart=apart), lora_rank,
                               elem_bytes)
        sol = solve_lp(model, budget)
        cand = _candidate(model, sol[0], budget, None) if sol is not None else None
        if cand is None or cand.policy in seen:
            continue
        seen.add(cand.policy)
        blocks = -(-batch // model.ch.bls)
        cand.prediction.throughput = batch * seq_len / (blocks * cand.prediction.latency)
        out.append((cand, blocks))
    if not out:
        model = TrainCostModel(spec, hw, seq_len, TrainChoice(1, 1, compress_weight != "off"), lora_rank,
                               elem_bytes)
        need = model.memory({v: float(v[1] == "d" or v == "hg") for v in model.vars})
        gib = 2**30
        raise MemoryBudgetError(
            f"no training policy fits: one sequence of {seq_len} tokens with everything on disk needs "
            f"{need['gpu'] / gib:.2f} GiB of GPU memory (have {budget.gpu / gib:.2f} GiB); raise --gpu-mem, "
            "lower --max-seq-len" + (" or allow --compress-weight" if compress_weight == "off" else ""))
    best = max(c.prediction.throughput for c, _ in out)
    # equal predictions (compute-bound shapes of the same tokens): fewer blocks, then larger GPU batches
    out.sort(key=lambda cb: (-round(cb[0].prediction.throughput / best, 6), cb[1], cb[0].policy.num_gpu_batches))
    return [c for c, _ in out]


def _rows(model: CostModel, frac: dict[str, float]) -> dict[str, float]:
    """A placement's row fractions: its cache's and hidden states' (what rounds to whole rows)."""
    return {v: frac[v] for v in model.vars if v[0] in "ch"}


def _weights_around(model: CostModel, frac: dict[str, float], budget: Budget,
                    max_latency: float | None) -> tuple[Policy, dict[str, float]] | None:
    """The rounding `frac` with its rows (cache, hidden states) kept whole and the weights placed
    again by the LP around them, rounded as the search rounds; None where nothing fits. A row a
    tier gains in rounding can take more than the LP left free there, while the weights could
    make up for it in another tier."""
    rows = _rows(model, frac)
    sol = solve_lp(model, budget, max_latency, fixed=rows)
    if sol is None:
        return None
    return round_policy(_fit_slots(model, {**sol[0], **rows}, budget), model.ch)


def _fit_slots(model: CostModel, x: dict[str, float], budget: Budget) -> dict[str, float]:
    """The LP's fractions with weights moved from the GPU to the CPU until the GPU slots, staged
    from whole tensors as the engine stages them (the LP counts only the bytes beyond the GPU
    share), fit the GPU budget; and, where the LP put weights on the disk and filled the CPU, as
    many on from the CPU to the disk (a placement the LP kept off the disk is not given disk
    weights it did not choose)."""
    for _ in range(4):
        over = model.memory(x)["gpu"] - budget.gpu
        if over <= 0 or x["wg"] <= 0:
            break
        freed = max(model.W_total - model.slots * model.W_max, 1.0)  # GPU bytes per unit of wg moved
        d = min(x["wg"], over / freed + 1e-3)
        x = {**x, "wg": x["wg"] - d, "wc": x["wc"] + d}
        over_cpu = model.memory(x)["cpu"] - budget.cpu
        if over_cpu > 0 and x["wd"] > 1e-6:
            d = min(x["wc"], over_cpu / max(model.W_total, 1.0) + 1e-3)
            x = {**x, "wc": x["wc"] - d, "wd": x["wd"] + d}
    return x
