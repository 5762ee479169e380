"""`--policy auto`: search a policy for this job on this machine, and make sure it runs.

Knows: where the hardware profile comes from (a preset, a file, or this
machine's cached profile, measured once), the job's workload (longest prompt,
longest generation, number of prompts), a training step's (micro-batch,
longest sequence, LoRA rank) or a co-served block's (both, and the inference
slowdown allowed), the user's budgets, and that the
search's winner must also pass the engine's own memory accounting; the first
candidate that does is used.
Does not know: the cost model's terms (policy/) or the schedule (offload/).
"""

from __future__ import annotations

from typing import Any, Callable

import click

from flexoff import profiler, trials
from flexoff.errors import MemoryBudgetError
from flexoff.offload.adapters import Need
from flexoff.offload.engine import adapter_bytes
from flexoff.offload.layout import Layout
from flexoff.offload.memory import MemoryPlan, check, plan_memory
from flexoff.offload.placement import TIERS
from flexoff.policy.calibration import at_cpu_attention
from flexoff.policy.coserve_cost import CoServePlan, rank, search_coserve
from flexoff.policy.cost_model import Workload
from flexoff.policy.policy import Policy
from flexoff.policy.search import Budget, Candidate, default_shapes, search, search_training


def engine_plan(llm: Any, policy: Policy, prompt_len: int, gen_len: int, training: bool = False,
                need: Need | None = None, windows: int | None = None) -> MemoryPlan:
    """What the engine would allocate for this policy (`need`: its adapters' room, if not the job's;
    training, the trained adapter's; `windows`: of a co-served block's batches, those that train)."""
    from flexoff.quant.engine import formats

    spec, policy = llm.plan_spec, llm.stage_policy(policy)  # a pipeline's heaviest stage
    fmt, codec = formats(policy, spec, llm.dtype)
    layouts = [Layout(fmt.fields(l)) for l in spec.layers]
    need = need if need is not None else llm.adapter_need(policy.block_size)
    return plan_memory(spec, layouts, codec.rec_bytes, policy, prompt_len, gen_len, llm.dtype,
                       llm.device.type == "cuda", training,
                       adapters=adapter_bytes(need, llm.adapter_host_bytes(need, policy.lora_cache_blocks), layouts,
                                             policy, llm.dtype),
                       trained=need.elements if training else 0, windows=windows)


def _budget(llm: Any) -> tuple[Any, Budget]:
    """The hardware profile, and the memory the search may plan with: the user's budgets within
    the machine's, less the margin left after running out of GPU memory."""
    hw = profiler.load(llm.hardware, llm.options.offload_dir, log=lambda s: click.echo(s, err=True))
    b = llm.options.budgets
    budget = Budget.of(hw, b.gpu, b.cpu, b.disk)
    share = llm.world.local_size if llm.world is not None else 1  # the host's processes share its memory, disk
    return hw, Budget(budget.gpu - llm.gpu_margin, min(budget.cpu, hw.cpu_mem / share),
                      min(budget.disk, hw.disk_mem / share))


def _first_that_fits(llm: Any, budget: Budget, searched: Callable[[Budget], list[Any]],
                     plan: Callable[[Any], MemoryPlan],
                     key: Callable[[Any], Any] = lambda c: c.prediction.throughput) -> Any:
    """The best searched candidate (a Candidate, or anything with its policy and prediction,
    ranked by `key`, larger first) that the engine's own accounting (`plan`) accepts. Where the
    engine needs more than the cost model counted for candidates ranked above the first that
    passes (alignment, staging of whole tensors), the search is run again with budgets lowered by
    the difference, and the better of the passing candidates is kept."""
    error: MemoryBudgetError | None = None
    best: Any = None
    for _ in range(4):
        excess = {t: 0.0 for t in TIERS}
        for cand in searched(budget)[:8]:
            if best is not None and key(cand) <= key(best):
                break  # ranked best first: nothing further down beats what passed already
            need = plan(cand)
            try:
                check(need, llm.options.budgets, llm.device, llm.options.offload_dir)
            except MemoryBudgetError as e:
                error = e
                for t in TIERS:
                    excess[t] = max(excess[t], need.total(t) - cand.prediction.memory[t])
                continue
            best = cand
            break
        if not any(v > 0 for v in excess.values()):
            break  # the round's best passed (or nothing better was left to try)
        budget = Budget(*(getattr(budget, t) - max(0.0, excess[t]) for t in TIERS))
        if min(budget.gpu, budget.cpu, budget.disk) <= 0:
            break
    if best is None:
        raise MemoryBudgetError(f"no searched policy passes the engine's memory check: {error}")
    return best


def auto_policy(llm: Any, prompt_len: int, gen_len: int, num_prompts: int | None, **search_args: Any) -> Policy:
    """The best searched policy that the engine's own accounting accepts. In a pipeline the search
    plans the heaviest stage, whose engine holds one of the policy's blocks per stage
    (LLM.stage_policy)."""
    hw, budget = _budget(llm)
    work = Workload(prompt_len, gen_len, llm.dtype.itemsize, num_prompts, llm.lora_ranks(), llm.lora_held())
    stages = llm.residency.pipe.stages if llm.residency.pipe is not None else 1
    if stages > 1 and "shapes" not in search_args:  # a stage holds one block per stage: plan its shape
        search_args["shapes"] = default_shapes(num_prompts, stages)
    args = {"compress_weight": llm.compression[0], "compress_cache": llm.compression[1], **search_args}

    def at(rate: float) -> Candidate:  # the best that fits, CPU attention priced at `rate`
        priced = at_cpu_attention(hw, rate) if rate != hw.cpu_attn_bdw else hw

        def searched(b: Budget) -> list[Candidate]:
            cands = search(llm.plan_spec, priced, work, b, **args)
            for c in cands:  # a stage's share of the searched block
                c.policy = c.policy.replace(num_gpu_batches=c.policy.num_gpu_batches // stages)
            return cands

        return _first_that_fits(llm, budget, searched, lambda c: engine_plan(llm, c.policy, prompt_len, gen_len))

    best = at(hw.cpu_attn_bdw)
    llm.last_trials = []
    if not trials.applies(llm, stages, hw) or not trials.worth_trying([best, best], gen_len, num_prompts):
        return best.policy  # (even the fewest trials, two plans like the best, would cost too much)
    cands = [best]
    for f in (1 - trials.LANE_SPREAD, 1 + trials.LANE_SPREAD):
        try:
            cands.append(at(hw.cpu_attn_bdw * f))
        except MemoryBudgetError:  # nothing searched at that rate passes the engine's check
            pass
    cands = trials.distinct(cands)
    if not trials.worth_trying(cands, gen_len, num_prompts):
        return best.policy
    say = lambda s: click.echo(s, err=True)  # noqa: E731
    say(f"timing {len(cands)} searched policies the cost model ranks within its error "
        f"(CPU attention at {hw.cpu_attn_bdw / 1e9:.1f} GB/s and {trials.LANE_SPREAD:.0%} either side; "
        f"{trials.ENV}=0 to take the first)")
    policy, llm.last_trials = trials.choose(llm, cands, prompt_len, gen_len, say)
    return policy


def auto_training_policy(llm: Any, seq_len: int, batch: int, adapter: str) -> Candidate:
    """The best searched training policy (and its prediction) for micro-batches of `batch`
    sequences of up to `seq_len` tokens of the loaded adapter `adapter` that the engine's
    accounting accepts."""
    hw, budget = _budget(llm)
    need = llm.adapter_pool().need([[adapter]])
    searched = lambda b: search_training(llm.plan_spec, hw, seq_len, batch, b,  # noqa: E731
                                         lora_rank=llm.adapter_rank(adapter), compress_weight=llm.compression[0],
                                         elem_bytes=llm.dtype.itemsize)
    return _first_that_fits(llm, budget, searched,
                            lambda c: engine_plan(llm, c.policy, seq_len, 1, training=True, need=need))


def auto_coserve_plan(llm: Any, prompt_len: int, gen_len: int, num_prompts: int, *, seq_len: int,
                      window_rows: int, lora_rank: float, limit: float | None, max_windows: int,
                      need: Need) -> CoServePlan:
    """The best searched co-served plan (policy/coserve_cost.py) that the engine's accounting
    accepts for a block of inference prompts with training windows of up to `seq_len` tokens
    (`need`: the room of the block's adapters, the trained ones among them)."""
    hw, budget = _budget(llm)
    work = Workload(prompt_len, gen_len, llm.dtype.itemsize, num_prompts, llm.lora_ranks(), llm.lora_held())
    searched = lambda b: search_coserve(  # noqa: E731
        llm.plan_spec, hw, work, b, seq_len, window_rows=window_rows, lora_rank=lora_rank, limit=limit,
        max_windows=max_windows, compress_weight=llm.compression[0], compress_cache=llm.compression[1])
    return _first_that_fits(llm, budget, searched, lambda p: engine_plan(
        llm, p.policy, max(prompt_len, seq_len), gen_len, training=True, need=need, windows=p.windows), rank(limit))
