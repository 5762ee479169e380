"""A decode step's projections alone, with and without LoRA: LLaMA-7B's blocks (q/k/v stacked,
o, gate/up stacked, down) on one token per row, every projection of the step captured in one
CUDA graph, so the time each way of adding the deltas adds to a step is measured without
attention, sampling or the host.

Knows: the ways compared, each through `lora_linears` on the same block of adapters held as the
engine's adapter pool holds them when the weights are resident (rank lanes per matmul):
- `base`: the base matmuls alone;
- `dense`: as the engine runs decode rows (kernels.lora.DENSE): one matmul shrinks every token
  onto every lane, a mask keeps its own adapter's, one batched matmul expands a stack's lanes
  (q, k, v; gate, up), the shrink beside the base matmul on a stream of its own;
- `dense-unbatched`: the same with one matmul per projection's expand;
- `dense-inline`: `dense` on one stream;
- `passes`: the token-by-token shrink and expand kernels (DENSE off; what a paged pool runs),
  beside the base matmul on a stream of their own;
- `passes-inline`: the same written first, the base matmul added onto them.
Rows are grouped by adapter (as a job's blocks group them). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, gpu_seconds, table, write_jsonl  # noqa: E402
from lora import RANKS, profiled  # noqa: E402

GROUPS = (("attn", ("q_proj", "k_proj", "v_proj")), ("attn", ("o_proj",)), ("mlp", ("gate_proj", "up_proj")),
          ("mlp", ("down_proj",)))


def block_of(spec: Any, n: int, rows: int, seed: int, device: torch.device) -> tuple[Any, list[str]]:
    """A pool holding n adapters of ranks drawn from RANKS on every linear, begun on a block of
    `rows` rows grouped by adapter (each used), and the rows' adapter names."""
    from flexoff.offload.adapters import AdapterPool
    from flexoff.profiler import random_adapter

    g = torch.Generator().manual_seed(seed)
    ranks = [RANKS[i] for i in torch.randint(0, len(RANKS), (n,), generator=g).tolist()]
    adapters = [random_adapter(f"a{i}", spec, r, seed + i, device, torch.float16) for i, r in enumerate(ranks)]
    pool = AdapterPool(adapters, device, torch.float16, spec)
    names = [f"a{r * n // rows}" for r in range(rows)]
    resident = SimpleNamespace(splits=[SimpleNamespace(resident=True)], slots=[])
    pool.begin(names, pool.need([names]), resident)
    return pool, names


VARIANTS = {"base": None, "dense": (True, True, True), "dense-unbatched": (True, True, False),
            "dense-inline": (True, False, True), "passes": (False, True, False),
            "passes-inline": (False, False, False)}  # (DENSE, SIDE_STREAM, BATCHED_EXPAND)


def run_group(variant: str, weights: dict, xs: dict, pool: Any, ids: torch.Tensor, host: tuple[int, ...],
              outs: dict, key: Any) -> list[torch.Tensor]:
    """One group's projections (by its key) the variant's way: each projection's outputs."""
    from flexoff.kernels import lora as L

    w, x = weights[key], xs[weights[key].shape[1]]
    if VARIANTS[variant] is None:
        return [F.linear(x, w)]
    saved = L.DENSE, L.SIDE_STREAM, L.BATCHED_EXPAND
    L.DENSE, L.SIDE_STREAM, L.BATCHED_EXPAND = VARIANTS[variant]
    try:
        packs = [pool.packs[(key[0], f"{p}.weight")] for p in key[1]]
        return L.lora_linears(x, w, None, outs[key], ids, packs, host, kernels=True)
    finally:
        L.DENSE, L.SIDE_STREAM, L.BATCHED_EXPAND = saved


def setup(model: str, rows: int, blocks: int, device: str) -> tuple[Any, dict, dict, dict]:
    """The model's spec, its first `blocks` blocks' (0: all) stacked base weights by (layer,
    group), inputs by width and each group's projection widths."""
    from flexoff.checkpoint import load_model

    spec = load_model(model).spec
    layers = [j for j, lay in enumerate(spec.layers) if lay.kind in ("attn", "mlp")][:2 * (blocks or spec.num_layers)]
    shapes = {t.name: t.shape for layer in spec.layers for t in layer.tensors if t.matmul}
    weights = {}
    for j in layers:
        for kind, names in GROUPS:
            if spec.layers[j].kind == kind:
                weights[(j, names)] = torch.randn(sum(shapes[f"{n}.weight"][0] for n in names),
                                                  shapes[f"{names[0]}.weight"][1], dtype=torch.float16,
                                                  device=device) * 0.01
    xs = {k: torch.randn(rows, k, dtype=torch.float16, device=device) for k in {w.shape[1] for w in weights.values()}}
    outs = {key: [shapes[f"{p}.weight"][0] for p in key[1]] for key in weights}
    return spec, weights, xs, outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-7b")
    ap.add_argument("--adapters", default="12,123", help="adapters in the block (a list: one run each)")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=0, help="transformer blocks (default: the model's)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", default="", help="variants whose step runs under torch's profiler (a list)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/lora_step.jsonl"))
    args = ap.parse_args(argv)
    if cuda_missing("lora_step.py"):
        return 2
    spec, weights, xs, outs = setup(args.model, args.rows, args.blocks, "cuda")
    blocks = args.blocks or spec.num_layers
    rows, env, profiles = [], environment(), {}
    for n in [int(a) for a in args.adapters.split(",")]:
        pool, names = block_of(spec, n, args.rows, args.seed, torch.device("cuda"))
        ids, host = pool.ids(names)
        def step(v: str) -> Any:
            return lambda: [run_group(v, weights, xs, pool, ids, host, outs, k) for k in weights]

        times = {v: gpu_seconds(step(v), 1) for v in args.variants.split(",")}
        for v in [v for v in args.profile.split(",") if v]:
            profiles[(n, v)] = profiled(f"{n} adapters, {v}", step(v))
        key = next(iter(weights))  # the ways agree: the first group's outputs, densely and by the passes
        got = {v: torch.cat(run_group(v, weights, xs, pool, ids, host, outs, key), -1).float()
               for v in ("dense", "passes")}
        diff = (got["dense"] - got["passes"]).abs().max().item()
        ranks = [r for k in weights for p in k[1] for r in pool.packs[(k[0], f"{p}.weight")].ranks[:n]]
        for v, sec in times.items():
            rows.append({"variant": v, "adapters": n, "mean_rank": sum(ranks) / len(ranks), "batch": args.rows,
                         "blocks": blocks, "step_ms": 1e3 * sec, "adds_ms": 1e3 * (sec - times.get("base", sec)),
                         "max_diff_dense_vs_passes": diff, **env,
                         **({"profile": profiles[(n, v)]} if (n, v) in profiles else {})})
        print(table(rows[-len(times):], ["variant", "adapters", "mean_rank", "step_ms", "adds_ms",
                                         "max_diff_dense_vs_passes"]), flush=True)
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
