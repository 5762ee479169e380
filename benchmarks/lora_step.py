"""A decode step's projections alone, with and without LoRA: LLaMA-7B's blocks (q/k/v stacked,
o, gate/up stacked, down) on one token per row, every projection of the step captured in one
CUDA graph, so the time each way of adding the deltas adds to a step is measured without
attention, sampling or the host.

Knows: the ways compared, each on the same block of adapters held as the adapter pool holds
them (resident: one device buffer, each adapter's matmuls one after another):
- `base`: the base matmuls alone;
- `kernels`: `lora_linears` as the engine runs it (the decode deltas on a side stream);
- `kernels-inline`: the same with the deltas written first and the base matmul added onto them;
- `dense`: the block's adapters laid out per matmul, one after another (A stacked over every
  adapter's rank, B likewise), so one cuBLAS matmul shrinks every token onto every adapter's
  ranks, a mask keeps each token's own adapter's lanes with its scale, and one more (per
  projection) expands them onto y; bytes: each adapter once, as the kernels read them;
- `dense-side`: the same with the shrink and the mask on a side stream beside the base matmul.
Rows are grouped by adapter (as a job's blocks group them). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, gpu_seconds, table, write_jsonl  # noqa: E402

RANKS = (8, 16, 32, 64)
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
    pool = AdapterPool(adapters, device, torch.float16)
    names = [f"a{r * n // rows}" for r in range(rows)]
    resident = SimpleNamespace(splits=[SimpleNamespace(resident=True)], slots=[])
    pool.begin(names, pool.need([names]), resident)
    return pool, names


def dense_group(packs: list[Any], ids: list[int], rows: int) -> dict[str, Any]:
    """One group's adapters per matmul: A of every adapter stacked (lanes, in) over the group's
    projections, each projection's B transposed stacked (lanes, out), and the mask (rows, lanes):
    a row's own adapter's lanes carry its scale, the rest zero."""
    As, Bs, spans, cols = [], [], [], []
    at = 0
    for p in packs:
        lo, mine = at, []
        for a in range(len(p.ranks)):
            if p.ranks[a] == 0:
                continue
            A, Bt = p.weights(a)
            As.append(A)
            mine.append(Bt)
            cols += [(a, p.scales[a])] * p.ranks[a]
            at += p.ranks[a]
        spans.append((lo, at))
        Bs.append(torch.cat(mine))
    owner = torch.tensor([a for a, _ in cols])
    scale = torch.tensor([s for _, s in cols], dtype=torch.float32)
    mask = (torch.tensor(ids)[:, None] == owner[None, :]) * scale[None, :]
    return {"A": torch.cat(As), "B": Bs, "spans": spans,
            "mask": mask.to(As[0].device, As[0].dtype)}


def ways(weights: dict, xs: dict, pool: Any, names: list[str], outs: dict) -> dict[str, Callable[[Any], Any]]:
    """Each way of computing one group's projections (by its key), returning y."""
    from flexoff.kernels.lora import _side_stream, lora_linears

    ids, host = pool.ids(names)
    rows = len(names)
    packs = {key: [pool.packs[(key[0], f"{p}.weight")] for p in key[1]] for key in weights}
    dense = {key: dense_group(ps, list(host), rows) for key, ps in packs.items()}

    def base(key: Any) -> Any:
        return F.linear(xs[weights[key].shape[1]], weights[key])

    def kernels(key: Any) -> Any:
        return torch.cat(lora_linears(xs[weights[key].shape[1]], weights[key], None, outs[key], ids, packs[key], host,
                                      kernels=True), -1)

    def dense_way(side: bool) -> Callable[[Any], Any]:
        def run(key: Any) -> Any:
            x, d = xs[weights[key].shape[1]], dense[key]
            if side and x.is_cuda:
                main = torch.cuda.current_stream()
                s = _side_stream(main)
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    v = F.linear(x, d["A"]).mul_(d["mask"])
                y = F.linear(x, weights[key])
                main.wait_stream(s)
            else:
                v = F.linear(x, d["A"]).mul_(d["mask"])
                y = F.linear(x, weights[key])
            c0 = 0
            for (lo, hi), b, w in zip(d["spans"], d["B"], outs[key]):
                y[:, c0:c0 + w].addmm_(v[:, lo:hi], b)
                c0 += w
            return y
        return run

    return {"base": base, "kernels": kernels, "kernels-inline": kernels, "dense": dense_way(False),
            "dense-side": dense_way(True)}


def setup(model: str, rows: int, blocks: int, device: str) -> tuple[Any, dict, dict, dict]:
    """The model's spec, its first `blocks` blocks' stacked base weights by (layer, group), inputs
    by width and each group's projection widths."""
    from flexoff.checkpoint import load_model

    spec = load_model(model).spec
    layers = [j for j, layer in enumerate(spec.layers) if layer.kind in ("attn", "mlp")][:2 * blocks]
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
    ap.add_argument("--variants", default="base,kernels,kernels-inline,dense,dense-side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/lora_step.jsonl"))
    args = ap.parse_args(argv)
    if cuda_missing("lora_step.py"):
        return 2
    from flexoff.checkpoint import load_model
    from flexoff.kernels import lora as L

    blocks = args.blocks or load_model(args.model).spec.num_layers
    spec, weights, xs, outs = setup(args.model, args.rows, blocks, "cuda")
    rows, env = [], environment()
    for n in [int(a) for a in args.adapters.split(",")]:
        pool, names = block_of(spec, n, args.rows, args.seed, torch.device("cuda"))
        way = ways(weights, xs, pool, names, outs)
        times = {}
        for v in args.variants.split(","):
            L.SIDE_STREAM = v != "kernels-inline"
            fn = way[v]
            times[v] = gpu_seconds(lambda: [fn(key) for key in weights], 1)
            L.SIDE_STREAM = True
        key = next(iter(weights))  # the ways agree: the first group's y by the kernels and the dense way
        diff = (way["kernels"](key).float() - way["dense"](key).float()).abs().max().item()
        ranks = [r for k in weights for p in k[1] for r in pool.packs[(k[0], f"{p}.weight")].ranks[:n]]
        for v, sec in times.items():
            rows.append({"variant": v, "adapters": n, "mean_rank": sum(ranks) / len(ranks), "batch": args.rows,
                         "blocks": blocks, "step_ms": 1e3 * sec, "adds_ms": 1e3 * (sec - times.get("base", sec)),
                         "max_diff_vs_kernels": diff, **env})
        print(table(rows[-len(times):], ["variant", "adapters", "mean_rank", "step_ms", "adds_ms",
                                         "max_diff_vs_kernels"]), flush=True)
        del pool, way
        torch.cuda.empty_cache()
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
