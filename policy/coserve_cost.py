"""The cost of a co-served block, and the joint search of inference's policy and training's share.

Knows: a co-served block as the engine runs it (offload.engine.run_block): K GPU batches of
inference rows and W GPU batches of training windows (sequences of up to S tokens of one LoRA
adapter of rank r), all padded to the longer of the prompts and the windows; the windows' forward
rides on the prefill sweep (each layer's weights are staged once for both: the windows add their
compute, their hidden states and their stash), the token steps run the inference batches only,
and the windows' reverse sweep stages every layer's weights again (train_cost.py's "b" sweep).
The block's memory is the engine's: every one of its K + W batches gets hidden-state homes, the
K inference batches KV cache homes, the W windows stash homes (or kept graphs), and the
optimizer holds the trained adapter's copies. Every term stays linear in the twelve placement
fractions, so the LP (search.solve_lp) places weights, cache, hidden states and stash for the
block as a whole.

The joint search: from the best standalone inference plans' discrete choices (search.search,
same budgets), the same with fewer inference batches and the same block in smaller GPU batches,
and 1 up to a cap of window batches, the LP's placement of each; under a limit, the share of
blocks that may take windows while the job's predicted inference throughput keeps at least
(1 - limit) of the best standalone plan's (the other blocks run without), and the plan with the
most training tokens per second at its share (ties: the faster inference). Without a limit,
windows in every block and the fastest inference first.
Does not know: the engine, the runtime bound (finetune.coserve.SlowdownBound checks the
measured slowdown block by block; the plan gives it the bound that yields the planned share).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from flexoff.errors import MemoryBudgetError
from flexoff.models.spec import ModelSpec
from flexoff.policy.cost_model import KINDS, Choice, CostModel, Prediction, Workload
from flexoff.policy.hardware import Hardware
from flexoff.policy.policy import Policy
from flexoff.policy.search import GPU_BATCH_SIZES, NUM_GPU_BATCHES, Budget, Candidate, Toggle, _candidate, search, solve_lp
from flexoff.policy.train_cost import TRAIN_VARS, TrainChoice, TrainCostModel

WINDOW_COUNTS = (1, 2, 3, 4, 6, 8)  # window batches a block may take, as searched (up to the caller's cap)
TOP = 6  # the standalone search's best candidates whose choices the joint search starts from
SMALLER = 3  # ... and for each, this many smaller counts of inference batches (windows take room)


class CoServeCostModel(CostModel):
    """K inference batches (the choice's) generating n tokens, and `windows` training batches of
    `rows` sequences of `seq_len` tokens (rows <= the GPU batch size) riding on the block's
    prefill sweep, then their reverse sweep ("b")."""

    vars = TRAIN_VARS

    def __init__(self, spec: ModelSpec, hw: Hardware, work: Workload, choice: Choice, windows: int, seq_len: int,
                 lora_rank: float = 16, keep_graphs: bool = False, rows: int | None = None):
        padded = replace(work, prompt_len=max(work.prompt_len, seq_len))  # the block's padded length
        super().__init__(spec, hw, padded, choice)
        gbs, eb = choice.gpu_batch_size, work.elem_bytes
        self.windows, self.S, self.rows = windows, seq_len, min(rows or gbs, gbs)
        tc = dict(compress_weight=choice.compress_weight, overlap=choice.overlap, keep_graphs=keep_graphs)
        self.win = TrainCostModel(spec, hw, seq_len, TrainChoice(self.rows, windows, **tc), lora_rank, eb)
        whole = replace(choice, num_gpu_batches=choice.num_gpu_batches + windows)
        self.block = CostModel(spec, hw, padded, whole)  # hidden-state homes of all K + W batches
        self.alone = CostModel(spec, hw, padded, choice)  # the same block without windows
        # the stash (or kept graphs) of the windows' batches, whole GPU batches as the engine plans them
        self.homes = TrainCostModel(spec, hw, padded.prompt_len, TrainChoice(gbs, windows, **tc), lora_rank, eb)

    def sweep_count(self, stage: str) -> int:
        return 1 if stage in ("p", "b") else self.work.gen_len - 1

    def bounds(self) -> dict[str, tuple[float, float]]:
        return self.win.bounds()

    # ---- time ----------------------------------------------------------
    def terms(self, x: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        inference = super().terms(x)
        riders = self.win.terms({**x, "wc": 0, "wd": 0})  # their forward's own traffic: the weights are staged once
        train = self.win.terms(x)
        out = dict(inference)
        for k in KINDS:
            p, f = inference[("p", k)], riders[("f", k)]
            out[("p", k)] = {name: p.get(name, 0) + f.get(name, 0) for name in {*p, *f}}
            out[("b", k)] = train[("b", k)]
        return out

    # ---- memory --------------------------------------------------------
    def memory(self, x: Mapping[str, Any]) -> dict[str, Any]:
        """The block of K + W batches with the KV cache of the K inference batches only (a window
        keeps none), and the windows' stash or kept graphs and the optimizer."""
        base, extra = self.block.memory(x), self.homes.training_memory(x)
        whole, infer = self.block.cache_memory(x), self.alone.cache_memory(x)
        return {t: base[t] - whole[t] + infer[t] + extra[t] for t in base}

    # ---- evaluation ----------------------------------------------------
    def evaluate(self, x: Mapping[str, float]) -> Prediction:
        """prefill_s: the prefill sweep with the windows' forward; decode_s: the token steps and the
        windows' reverse sweep; throughput: the job's generated tokens per second."""
        terms = self.terms(x)
        sweep = {s: sum(self.count[k] * self.layer_time(terms[(s, k)]) for k in KINDS) for s in ("p", "g", "b")}
        pair = self.layer_time(terms[("g", "attn")]) + self.layer_time(terms[("g", "mlp")])
        pool = self.pair_pool(x, terms)[1]
        sweep["g"] += self.count["attn"] * max(0.0, pool - pair)
        decode = (self.work.gen_len - 1) * sweep["g"] + sweep["b"]
        stage, worst = max(((s, k) for s in ("p", "g", "b") for k in KINDS),
                           key=lambda sk: self.sweep_count(sk[0]) * self.count[sk[1]] * self.layer_time(terms[sk]))
        term = max(terms[(stage, worst)].items(), key=lambda kv: kv[1])[0]
        name = {"p": "prefill with windows", "g": "decode", "b": "windows' reverse sweep"}[stage]
        return Prediction(sweep["p"], decode, self.throughput(sweep["p"] + decode), f"{term} ({worst} layers, {name})",
                          {t: float(v) for t, v in self.memory(x).items()},
                          {f"{s}/{k}": {a: float(b) for a, b in v.items()} for (s, k), v in terms.items()})

    def training_throughput(self, latency: float) -> float:
        """Training tokens per second of a block that takes `latency` seconds."""
        return self.windows * self.rows * self.S / latency


@dataclass
class CoServePlan:
    """A co-served block: its policy (inference and window batches together), how many of its
    batches are windows, the share of blocks that take them, and what the cost model predicts."""
    candidate: Candidate  # the policy's num_gpu_batches counts the windows' batches too
    windows: int
    share: float  # of the blocks, those that take windows (the others run inference alone)
    inference_tps: float  # generated tokens / s over the job, windows in `share` of the blocks
    training_tps: float  # training tokens / s, likewise
    standalone_tps: float  # the best inference plan alone, same budgets
    block_slowdown: float  # what a block's windows add to its time, over the block without them

    @property
    def policy(self) -> Policy:
        return self.candidate.policy

    @property
    def prediction(self) -> Prediction:
        """The cost model's prediction of a block with windows."""
        return self.candidate.prediction

    @property
    def slowdown(self) -> float:
        """Inference throughput lost against inference alone, as predicted (0.1: 10%)."""
        return 1 - self.inference_tps / self.standalone_tps

    @property
    def runtime_limit(self) -> float:
        """The bound for the blocks' measured slowdown (finetune.coserve.SlowdownBound, which
        measures against this policy's blocks without windows) that gives windows this share."""
        return self.share * self.block_slowdown

    def describe(self) -> str:
        if self.share == 0:
            return (f"no block has room for windows within the bound (the best plan would run "
                    f"{100 * self.slowdown:.1f}% below inference alone): inference runs alone, the jobs after it")
        return (f"windows take {self.windows} of {self.policy.num_gpu_batches} GPU batches in "
                f"{100 * self.share:.0f}% of blocks; planned {self.inference_tps:.1f} generated tok/s "
                f"({100 * self.slowdown:.1f}% below inference alone) and {self.training_tps:.0f} training tok/s")


def _plan(model: CoServeCostModel, cand: Candidate, standalone: float, limit: float | None) -> CoServePlan:
    """The plan of a co-served candidate: the share of blocks whose windows keep inference within
    `limit` of `standalone` (all, without a limit), and both sides' throughputs at that share."""
    with_windows = cand.prediction.latency
    assert cand.fractions is not None
    alone = model.alone.evaluate(cand.fractions).latency
    extra = max(0.0, with_windows - alone)
    share = 1.0
    if limit is not None and extra > 0:
        allowed = model.throughput(1.0) / ((1 - limit) * standalone)  # the longest mean block that keeps it
        share = min(1.0, max(0.0, (allowed - alone) / extra))
    mean = alone + share * extra
    return CoServePlan(cand, model.windows, share, model.throughput(mean),
                       share * model.training_throughput(1.0) / mean, standalone, extra / alone)


def _near(cands: list[Candidate], window_rows: int | None) -> list[Choice]:
    """The discrete choices of the best standalone candidates; the same with fewer inference
    batches; and about the same rows a block in smaller GPU batches, down to the first that holds
    a window's rows (a window batch's homes are a whole GPU batch's), each once."""
    out: list[Choice] = []
    for c in cands:
        p = c.policy
        fewer = [n for n in NUM_GPU_BATCHES if n < p.num_gpu_batches][-SMALLER:]
        least = next((g for g in GPU_BATCH_SIZES if g >= (window_rows or 1)), GPU_BATCH_SIZES[-1])
        smaller = [g for g in GPU_BATCH_SIZES if least <= g < p.gpu_batch_size]
        split = [(g, max(n for n in NUM_GPU_BATCHES if n * g <= p.block_size))
                 for g in smaller[-SMALLER:] + smaller[:1] if g <= p.block_size]
        for gbs, nb in [(p.gpu_batch_size, p.num_gpu_batches)] + [(p.gpu_batch_size, n) for n in reversed(fewer)] \
                + list(reversed(split)):
            ch = Choice(gbs, nb, p.compress_weight, p.compress_cache, p.cpu_cache_compute, p.overlap, p.quant_bits,
                        p.quant_group, p.lora_cache_blocks)
            if ch not in out:
                out.append(ch)
    return out


def search_coserve(spec: ModelSpec, hw: Hardware, work: Workload, budget: Budget, seq_len: int, *,
                   window_rows: int | None = None, lora_rank: float = 16, limit: float | None = None,
                   max_windows: int = 1,
                   compress_weight: Toggle = "off", compress_cache: Toggle = "off", cpu_attention: Toggle = "auto",
                   overlap: bool = True, shapes: Iterable[tuple[int, int]] | None = None) -> list[CoServePlan]:
    """Co-served plans, best first (the module's docstring says how they rank). `window_rows`: the
    training sequences a block can carry (the jobs' examples of a step; None: no limit), so a
    window batch holds at most that many and a block takes no more batches than they fill;
    `max_windows`: the most window batches a block may take (without a limit, that many where the
    rows fill them). Raises MemoryBudgetError if no block with a window fits."""
    ranked = search(spec, hw, work, budget, compress_weight=compress_weight, compress_cache=compress_cache,
                    cpu_attention=cpu_attention, overlap=overlap, shapes=shapes)
    standalone = ranked[0].prediction.throughput
    counts = sorted({w for w in WINDOW_COUNTS if w <= max_windows} | {max_windows}) if limit is not None \
        else [max_windows]
    plans, seen = [], set()
    for choice, keep, w in itertools.product(_near(ranked[:TOP], window_rows), (False, True), counts):
        gbs = choice.gpu_batch_size
        w = min(w, -(-window_rows // gbs)) if window_rows is not None else w  # windows beyond the rows stay empty
        if keep and choice.cpu_cache_compute:
            continue  # kept graphs need every weight on the GPU
        rows = gbs if window_rows is None else min(gbs, -(-window_rows // w))
        model = CoServeCostModel(spec, hw, work, choice, w, seq_len, lora_rank, keep, rows)
        sol = solve_lp(model, budget)
        cand = _candidate(model, sol[0], budget, None) if sol is not None else None
        if cand is None:
            continue
        cand.policy = cand.policy.replace(num_gpu_batches=choice.num_gpu_batches + w)
        if cand.policy in seen:
            continue
        seen.add(cand.policy)
        plans.append(_plan(model, cand, standalone, limit))
    if not plans:
        raise MemoryBudgetError(f"no co-served block fits: a block with a training window of {seq_len} tokens "
                                "needs more memory than the budgets give; raise them or shorten the sequences")
    return sorted(plans, key=rank(limit), reverse=True)


def rank(limit: float | None) -> Callable[[CoServePlan], tuple[float, float]]:
    """How plans compare, larger first: without a limit inference first; with one, the most
    training (at the share of blocks the bound leaves it), then the faster inference."""
    if limit is None:
        return lambda p: (p.inference_tps, p.training_tps)
    return lambda p: (round(p.training_tps, 9), p.inference_tps)
