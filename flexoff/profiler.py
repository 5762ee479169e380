"""This machine's profile for the cost model: what policy.hardware measures (links, GPU, CPU,
disk) plus the engine's own host time per step, which only running the engine can measure
(policy/ never imports the engine or the API).

Knows: how to time the engine's per-step host work on a tiny model, and how to put it into
a Hardware profile. Does not know: the cost model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from flexoff.api import LLM
from flexoff.policy import hardware
from flexoff.policy.hardware import Hardware
from flexoff.policy.policy import Policy


def host_step(dev: torch.device, offload_dir: str | None = None, nb: int = 4, gen: int = 16) -> float:
    """Seconds of host work per engine step (one layer of one GPU batch): the decode of a tiny
    model, whose kernels take next to no time, with its KV cache compressed in CPU memory and
    its activations there too (a step's most work: loads, stores, quantization), after a warm-up."""
    p = Policy(gpu_batch_size=2, num_gpu_batches=nb, cache_gpu_percent=0, cache_cpu_percent=100,
               act_gpu_percent=0, act_cpu_percent=100, compress_cache=True)
    prompts = [{"prompt_ids": [5 + i, 6, 7, 8]} for i in range(2 * nb)]
    with LLM("dummy:opt-tiny", policy=p, device=dev, offload_dir=offload_dir) as llm:
        llm.model.tokenizer.eos_ids = ()  # every step runs
        llm.generate(prompts, max_new_tokens=2)
        st = llm.generate(prompts, max_new_tokens=gen).stats
        steps = (gen - 1) * len(llm.model.spec.layers) * nb
    return st.decode_s / steps


def measure(offload_dir: str | None = None, quick: bool = False) -> Hardware:
    """Measure this machine, the engine's host step included."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return replace(hardware.measure(offload_dir, quick=quick), host_step_s=host_step(dev, offload_dir))


def load(name_or_path: str | None, offload_dir: str | None = None,
         log: Callable[[str], None] | None = None) -> Hardware:
    """hardware.load, measuring this machine with the host step when nothing is cached."""
    return hardware.load(name_or_path, offload_dir, log, measure_machine=measure)
