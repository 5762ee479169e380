"""This machine's profile for the cost model: what policy.hardware measures (links, GPU, CPU,
disk) plus the engine's own host time per step, which only running the engine can measure
(policy/ never imports the engine or the API).

Knows: how to time the engine's per-step host work on a tiny model and the rate of its
decode copies on a wider one, and how to put them into a Hardware profile. Does not know: the cost model.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from flexoff.adapters.peft import Adapter, LoraModule
from flexoff.api import LLM
from flexoff.dummy import CONFIGS, random_prompts
from flexoff.policy import hardware
from flexoff.policy.hardware import Hardware
from flexoff.policy.policy import Policy

HOST_STEP_REPEATS = 3  # measured runs of the host step, after a warm-up
PROBE_BLOCKS = 32  # transformer blocks of the profile's probe model (a 7B model's depth)
PROBE_VOCAB = CONFIGS["opt-tiny"]["vocab_size"]  # the probe models' vocabulary (the tiny model's)


def host_step(dev: torch.device, offload_dir: str | None = None, nb: int = 4, gen: int = 16,
              lora: bool = False, repeats: int = HOST_STEP_REPEATS, packed: bool = False,
              model: str = "dummy:opt-tiny") -> float:
    """Seconds of host work per engine step (one layer of one GPU batch): the median of
    host_step_runs on host_probe(nb). `packed`: the probe of the search's 4-bit policies, which
    stream 4-bit weights and split cache and activation rows between the device and CPU memory
    (on an H100, 4-bit steps of 32 rows x 8 batches took 0.94 ms with rows in CPU memory only
    and 1.26 ms split; benchmarks/RESULTS.md). One run after a two-token warm-up (as before)
    read 1.13 ms on an H100 where 24 later runs read 0.50-0.90: the first run at a length is
    slower."""
    probe = host_probe(nb, w_gpu_percent=0, compress_weight=True, split=True) if packed else host_probe(nb)
    return statistics.median(host_step_runs(dev, probe, model, gen=gen, lora=lora, repeats=repeats,
                                            offload_dir=offload_dir))


@contextmanager
def probe_model(blocks: int = PROBE_BLOCKS, widths: str = "opt-tiny") -> Iterator[str]:
    """A dummy model of the widths of `widths` (a dummy config; the tiny model's vocabulary) and
    `blocks` transformer blocks. The host probes use the tiny widths at a 7B model's depth: a
    step's host time grows with a model's depth (on an H100 the probe read 0.51 ms a step at
    the tiny model's 2 blocks and 0.86 ms at OPT-30B's 48; benchmarks/RESULTS.md), so the
    profile measures it at a depth like the models it prices."""
    with tempfile.TemporaryDirectory(prefix="flexoff-probe-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps({**CONFIGS[widths], "num_hidden_layers": blocks,
                                    "vocab_size": PROBE_VOCAB}))
        yield f"dummy:{path}"


def link_probe() -> Policy:
    """The policy of the decode link probe: 4-bit weights and KV cache in CPU memory, copied to
    the GPU at every decode step (as the 4-bit policies the search picks for OPT-30B on a 16 GiB
    GPU copy them), four GPU batches of 48 rows."""
    return Policy(gpu_batch_size=48, num_gpu_batches=4, w_gpu_percent=0, w_cpu_percent=100, cache_gpu_percent=0,
                  cache_cpu_percent=100, act_gpu_percent=0, act_cpu_percent=100, compress_weight=True,
                  compress_cache=True)


def decode_link_rate(dev: torch.device, offload_dir: str | None = None, repeats: int = HOST_STEP_REPEATS,
                     prompt_len: int = 512, gen: int = 17) -> float:
    """Bytes/s of the engine's host-to-device copies in decode while some copy is in flight (the
    median of `repeats` decodes after a warm-up), on two blocks of OPT-6.7B's widths under
    link_probe(): copies of tens to hundreds of MB, beside the engine's kernels and its other
    copies, where one copy alone on an idle device runs a few percent faster
    (benchmarks/RESULTS.md). 0 without CUDA (no link)."""
    if dev.type != "cuda":
        return 0.0
    policy = link_probe()
    prompts = random_prompts(policy.block_size, prompt_len, PROBE_VOCAB)
    with probe_model(blocks=2, widths="opt-6.7b") as model, \
            LLM(model, policy=policy, device=dev, offload_dir=offload_dir) as llm:
        llm.model.tokenizer.eos_ids = ()  # every step runs
        llm.generate(prompts, max_new_tokens=gen)
        rates = []
        for _ in range(repeats):
            traffic = llm.generate(prompts, max_new_tokens=gen).stats.traffic_decode
            if traffic.get("h2d_busy_s"):
                rates.append(traffic["h2d"] / traffic["h2d_busy_s"])
    return statistics.median(rates) if rates else 0.0


def host_probe(nb: int = 4, w_gpu_percent: float = 100, compress_weight: bool = False, split: bool = False) -> Policy:
    """The profile's policy for the host step: GPU batches of two rows, the KV cache compressed in
    CPU memory and the activations there too (a step's most work: loads, stores, quantization),
    `w_gpu_percent` of the weights on the device and the rest streamed from CPU memory; `split`:
    one row of each batch's cache and activations on the device instead (two segments a step)."""
    on_gpu = 50 if split else 0
    return Policy(gpu_batch_size=2, num_gpu_batches=nb, w_gpu_percent=w_gpu_percent, w_cpu_percent=100 - w_gpu_percent,
                  cache_gpu_percent=on_gpu, cache_cpu_percent=100 - on_gpu, act_gpu_percent=on_gpu,
                  act_cpu_percent=100 - on_gpu, compress_cache=True, compress_weight=compress_weight)


def host_step_runs(dev: torch.device, policy: Policy, model: str = "dummy:opt-tiny", gen: int = 16,
                   lora: bool = False, repeats: int = HOST_STEP_REPEATS, offload_dir: str | None = None) -> list[float]:
    """Seconds per engine step of `repeats` decodes of one block of four-token prompts for `gen`
    tokens under `policy`, after a warm-up of the same length, on a model whose kernels and copies
    take next to no time (the tiny one, or a config of its widths): the host's own work. `lora`:
    every row with an adapter of its own (rank 8 on every linear layer)."""
    n = policy.block_size
    prompts = [{"prompt_ids": [5 + i % 400, 6, 7, 8], "adapter": f"a{i}" if lora else None} for i in range(n)]
    with LLM(model, policy=policy, device=dev, offload_dir=offload_dir) as llm:
        llm.model.tokenizer.eos_ids = ()  # every step runs
        if lora:
            for i in range(n):
                llm.add_adapter(random_adapter(f"a{i}", llm.model.spec, 8, i))
        llm.generate(prompts, max_new_tokens=gen)
        steps = (gen - 1) * len(llm.model.spec.layers) * policy.num_gpu_batches
        return [llm.generate(prompts, max_new_tokens=gen).stats.decode_s / steps for _ in range(repeats)]


def random_adapter(name: str, spec: Any, rank: int, seed: int, device: torch.device = torch.device("cpu"),
                   dtype: torch.dtype = torch.float32) -> Adapter:
    """An adapter of one rank on every linear layer LoRA adapts, random values (std 0.01; for
    timing), made on `device` in `dtype` and kept in host memory."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.01).cpu()

    mods = {(j, t.name): LoraModule(rand(rank, t.shape[1]), rand(t.shape[0], rank), 2.0)
            for j, layer in enumerate(spec.layers) if layer.kind in ("attn", "mlp") for t in layer.tensors if t.matmul}
    return Adapter(name, "", mods)


def measure(offload_dir: str | None = None, quick: bool = False, log: Callable[[str], None] | None = None) -> Hardware:
    """Measure this machine, the engine's host step (and what LoRA adds to it) and its decode
    link rate included; `log` hears each stage as it starts."""
    say = log or (lambda _: None)
    # The machine's own rates first, as a fresh engine process meets them: on an H100 host, CPU
    # attention measured 20.5 GB/s after the engine probes below (and the GPU's rates) and
    # 47.6-51.5 GB/s in a fresh process (three rounds of 11 calls), where runs of the engine's
    # CPU attention reached 41-43 (benchmarks/host_rates.py compares the two in one process).
    say("profile 1/3: host, link, disk and GPU rates")
    measured = hardware.measure(offload_dir, quick=quick)
    return replace(measured, **engine_probes(offload_dir, quick, say))


def engine_probes(offload_dir: str | None = None, quick: bool = False,
                  log: Callable[[str], None] | None = None) -> dict[str, float]:
    """The profile's fields that runs of the engine measure: the host step (plain, what LoRA
    adds, 4-bit packed) and the decode link rate (not with `quick`); `log` hears each stage."""
    say = log or (lambda _: None)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    say("profile 2/3: the engine's host step (plain, with LoRA, 4-bit)")
    with probe_model() as model:
        base = host_step(dev, offload_dir, model=model)
        extra = max(0.0, host_step(dev, offload_dir, lora=True, model=model) - base)
        packed = host_step(dev, offload_dir, packed=True, model=model)
    if not quick and dev.type == "cuda":
        say("profile 3/3: the engine's decode link rate")
    link = 0.0 if quick else decode_link_rate(dev, offload_dir)
    return {"host_step_s": base, "lora_host_step_s": extra, "packed_host_step_s": packed, "decode_ctog_bdw": link}


def load(name_or_path: str | None, offload_dir: str | None = None,
         log: Callable[[str], None] | None = None) -> Hardware:
    """hardware.load, measuring this machine with the host step when nothing is cached."""
    return hardware.load(name_or_path, offload_dir, log, measure_machine=lambda where: measure(where, log=log))
