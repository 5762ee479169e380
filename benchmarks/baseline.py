"""The Hugging Face Accelerate offloading baseline on the same dummy weights flexoff runs.

Knows: building a transformers model from a flexoff dummy config, filling it with flexoff's
own seeded dummy weights (the same model), letting Accelerate place it with `device_map`
from `max_memory` budgets (layers that do not fit the GPU budget stay in CPU memory and are
moved to the GPU by Accelerate's hooks at every forward), and timing `generate` for a batch.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

# a change of the placed model before Accelerate dispatches it: (model, device map) -> both
Prepare = Callable[[Any, dict[str, Any]], tuple[Any, dict[str, Any]]]


def module_device(device_map: dict[str, Any], name: str) -> Any:
    best = ""
    for prefix in device_map:
        if (name == prefix or name.startswith(prefix + ".") or prefix == "") and len(prefix) >= len(best):
            best = prefix
    return device_map[best]


def hf_model(model_name: str, prompt_len: int, gen_len: int, batch: int, gpu_mem: int | None,
             cpu_mem: int | None, dtype: torch.dtype,
             prepare: Prepare | None = None) -> tuple[Any, dict[str, Any], float, Any]:
    """A transformers model holding flexoff's dummy weights, placed by Accelerate within the
    budgets: the model, its device map, the seconds setting it up took, and flexoff's spec.
    `prepare` changes the model and its map after the weights are placed, before the dispatch
    (PEFT's wrapping, whose trained weights must not be offloaded).

    The GPU budget holds Accelerate's resident layers and the KV cache of the batch; weights are
    given what is left after the cache and working memory that flexoff's model spec estimates."""
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoConfig, AutoModelForCausalLM

    from flexoff.checkpoint import load_model

    m = load_model(model_name)
    cfg = dict(m.config)
    cfg_obj = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    cuda = torch.cuda.is_available()
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg_obj, dtype=dtype)
    spec = m.spec
    if cuda:
        total = gpu_mem or torch.cuda.get_device_properties(0).total_memory
        cache = batch * (prompt_len + gen_len) * spec.kv_bytes_per_token(dtype.itemsize) * spec.num_layers
        working = spec.working_bytes(batch, prompt_len, dtype.itemsize, "cuda") + (1 << 30)
        max_memory = {0: max(0, total - cache - working), "cpu": cpu_mem or 10**13}
    else:
        max_memory = {"cpu": cpu_mem or 10**13}
    device_map = infer_auto_device_map(model, max_memory=max_memory, dtype=dtype,
                                       no_split_module_classes=model._no_split_modules)
    if "disk" in device_map.values():
        raise RuntimeError("the Accelerate baseline here supports GPU and CPU placement only; raise --cpu-mem")
    dev = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    for j, layer in enumerate(spec.layers):  # flexoff's dummy weights, so both run the same model
        tensors = m.source.layer(j, layer, dtype, dev)
        for t in layer.tensors:
            for name in t.hf_names[:1] if t.name != "lm_head.weight" or not cfg.get("tie_word_embeddings") else []:
                target = module_device(device_map, name.rsplit(".", 1)[0])
                set_module_tensor_to_device(model, name, "cuda:0" if target == 0 else target, tensors[t.name])
    model.tie_weights()
    for name, buf in list(model.named_buffers()):  # rotary tables and the like, initialized on the meta device
        if buf.is_meta:
            raise RuntimeError(f"buffer {name} was not materialized")
    if prepare is not None:
        model, device_map = prepare(model, device_map)
    model = dispatch_model(model, device_map=device_map, main_device=0 if cuda else "cpu")
    return model, device_map, time.perf_counter() - t0, spec


def accelerate_run(model_name: str, prompt_len: int, gen_len: int, batch: int, gpu_mem: int | None,
                   cpu_mem: int | None, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Generate gen_len tokens for `batch` random prompts with transformers + Accelerate."""
    model, device_map, setup_s, spec = hf_model(model_name, prompt_len, gen_len, batch, gpu_mem, cpu_mem, dtype)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, spec.vocab_size, (batch, prompt_len), generator=g).to(dev)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                             min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
        total_s = time.perf_counter() - t0
    generated = (out.shape[1] - prompt_len) * batch
    on_gpu = sum(1 for v in device_map.values() if v == 0)
    return {"system": "accelerate", "batch": batch, "total_s": total_s, "generated_tokens": generated,
            "generation_throughput": generated / total_s, "setup_s": setup_s,
            "placement": f"{on_gpu} of {len(device_map)} modules on GPU, the rest in CPU memory",
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0}
