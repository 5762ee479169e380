"""`--policy auto`: search a policy for this job on this machine, and make sure it runs.

Knows: where the hardware profile comes from (a preset, a file, or this
machine's cached profile, measured once), the job's workload (longest prompt,
longest generation, number of prompts), the user's budgets, and that the
search's winner must also pass the engine's own memory accounting; the first
candidate that does is used.
Does not know: the cost model's terms (policy/) or the schedule (offload/).
"""

from __future__ import annotations

from typing import Any

import click

from flexoff import profiler
from flexoff.errors import MemoryBudgetError
from flexoff.offload.engine import adapter_bytes
from flexoff.offload.layout import Layout
from flexoff.offload.memory import MemoryPlan, check, plan_memory
from flexoff.offload.placement import TIERS
from flexoff.policy.cost_model import Workload
from flexoff.policy.policy import Policy
from flexoff.policy.search import Budget, default_shapes, search


def engine_plan(llm: Any, policy: Policy, prompt_len: int, gen_len: int) -> MemoryPlan:
    """What the engine would allocate for this policy."""
    from flexoff.quant.engine import formats

    spec, policy = llm.plan_spec, llm.stage_policy(policy)  # a pipeline's heaviest stage
    fmt, codec = formats(policy, spec, llm.dtype)
    layouts = [Layout(fmt.fields(l)) for l in spec.layers]
    return plan_memory(spec, layouts, codec.rec_bytes, policy, prompt_len, gen_len, llm.dtype,
                       llm.device.type == "cuda",
                       adapters=adapter_bytes(llm.adapter_need(policy.block_size), llm.adapter_host_bytes(),
                                              layouts, policy, llm.dtype))


def auto_policy(llm: Any, prompt_len: int, gen_len: int, num_prompts: int | None, **search_args: Any) -> Policy:
    """The best searched policy that the engine's own accounting accepts. Where the engine needs
    more than the cost model counted (alignment, staging of whole tensors), the search is run
    again with budgets lowered by the difference. In a pipeline the search plans the heaviest
    stage, whose engine holds one of the policy's blocks per stage (LLM.stage_policy)."""
    hw = profiler.load(llm.hardware, llm.options.offload_dir, log=lambda s: click.echo(s, err=True))
    b = llm.options.budgets
    budget = Budget.of(hw, b.gpu, b.cpu, b.disk)
    share = llm.world.local_size if llm.world is not None else 1  # the host's processes share its memory, disk
    budget = Budget(budget.gpu - llm.gpu_margin, min(budget.cpu, hw.cpu_mem / share),
                    min(budget.disk, hw.disk_mem / share))
    work = Workload(prompt_len, gen_len, llm.dtype.itemsize, num_prompts, llm.lora_ranks())
    stages = llm.residency.pipe.stages if llm.residency.pipe is not None else 1
    if stages > 1 and "shapes" not in search_args:  # a stage holds one block per stage: plan its shape
        search_args["shapes"] = default_shapes(num_prompts, stages)
    error: MemoryBudgetError | None = None
    for _ in range(4):
        excess = {t: 0.0 for t in TIERS}
        args = {"compress_weight": llm.compression[0], "compress_cache": llm.compression[1], **search_args}
        cands = search(llm.plan_spec, hw, work, budget, **args)
        for cand in cands[:8]:
            policy = cand.policy.replace(num_gpu_batches=cand.policy.num_gpu_batches // stages)
            plan = engine_plan(llm, policy, prompt_len, gen_len)
            try:
                check(plan, b, llm.device, llm.options.offload_dir)
                return policy
            except MemoryBudgetError as e:
                error = e
            for t in TIERS:
                excess[t] = max(excess[t], plan.total(t) - cand.prediction.memory[t])
        budget = Budget(*(getattr(budget, t) - max(0.0, excess[t]) for t in TIERS))
        if min(budget.gpu, budget.cpu, budget.disk) <= 0:
            break
    raise MemoryBudgetError(f"no searched policy passes the engine's memory check: {error}")
