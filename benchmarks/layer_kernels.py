"""The decode step's own kernels on the GPU: decode attention over the engine's token-major cache
(each launch setting against the bytes it must read, and against torch's attention on a
head-major copy of the same cache), and the fused RMSNorm, rotary and silu * up kernels against
the torch chains they replace, at decode and prefill shapes of LLaMA-7B.

    python benchmarks/layer_kernels.py [--batch 8 --batch 32 ...] [--out benchmarks/out/layer_kernels.jsonl]

Prints a table per part (the fastest attention settings first) and writes JSON records.
Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_missing, environment, table, write_jsonl  # noqa: E402

HEADS, HEAD_DIM, HIDDEN, INTER = 32, 128, 4096, 11008  # LLaMA-7B


def bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds over CUDA events."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def attention_rows(batch: int, T: int, seen: int) -> list[dict[str, Any]]:
    """Every launch setting of the decode attention kernel at this batch, and torch's SDPA."""
    from flexoff.kernels import attention as A

    raw = torch.randn(T, batch, 2, HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    k, v = raw[:, :, 0].permute(1, 2, 0, 3), raw[:, :, 1].permute(1, 2, 0, 3)
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.float16)
    mask = torch.zeros(batch, 1, T, dtype=torch.bool, device="cuda")
    mask[..., :seen] = True
    read = 2 * batch * seen * HEADS * HEAD_DIM * 2  # keys and values of the positions seen
    want = A.decode_attention_ref(q, k, v, mask, HEAD_DIM ** -0.5).float()
    rows = []

    def add(name: str, ms: float, out: torch.Tensor | None, **kw: Any) -> None:
        err = (out.float() - want).abs().max().item() if out is not None else None
        rows.append({"part": "attention", "batch": batch, "variant": name, "ms": ms, "GB/s": read / ms / 1e6,
                     "max_err": err, **kw})

    for block, target, warps in itertools.product((32, 64, 128), (1024, 2048, 4096, 8192), (1, 2, 4)):
        fn = lambda: A.decode_attention_triton(q, k, v, mask, HEAD_DIM ** -0.5, block=block,  # noqa: E731
                                               target=target, warps=warps)
        name = f"b{block} t{target} w{warps}"
        try:
            add(name, bench(fn), fn(), block=block, target=target, warps=warps)
        except Exception as err:  # a setting that does not compile (registers): listed, not fatal
            rows.append({"part": "attention", "batch": batch, "variant": name, "error": str(err).splitlines()[0][:120]})
    kc, vc = k[..., :seen, :].contiguous(), v[..., :seen, :].contiguous()  # head-major, only the seen positions
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, kc, vc, scale=HEAD_DIM ** -0.5)  # noqa: E731
    add("torch SDPA, head-major copy", bench(fn), fn())
    return rows


def elementwise_rows(tokens: int) -> list[dict[str, Any]]:
    """Each fused kernel against its torch chain on `tokens` rows."""
    from flexoff.kernels import elementwise as E

    h = torch.randn(tokens, 1, HIDDEN, device="cuda", dtype=torch.float16)
    w = torch.rand(HIDDEN, device="cuda", dtype=torch.float16) + 0.5
    qkv = torch.randn(tokens, 1, 3 * HIDDEN, device="cuda", dtype=torch.float16)
    q = qkv[..., :HIDDEN].view(tokens, 1, HEADS, HEAD_DIM).transpose(1, 2)
    ang = torch.rand(tokens, 1, 1, HEAD_DIM // 2, device="cuda") * 100
    cos, sin = (torch.cat((f, f), -1).half() for f in (ang.cos(), ang.sin()))
    gu = torch.randn(tokens, 1, 2 * INTER, device="cuda", dtype=torch.float16)
    gate, up = gu.split([INTER, INTER], dim=-1)
    rows = []
    for name, fused, chain, moved in (
            ("rms_norm", lambda: E.rms_norm_triton(h, w, 1e-5), lambda: E.rms_norm_ref(h, w, 1e-5), 2 * h.nbytes),
            ("rotary", lambda: E.rotate_triton(q, cos, sin), lambda: E.rotate_ref(q, cos, sin), 2 * q.numel() * 2),
            ("silu_mul", lambda: E.silu_mul_triton(gate, up), lambda: E.silu_mul_ref(gate, up), 3 * gate.numel() * 2)):
        f, c = bench(fused), bench(chain)
        err = (fused().float() - chain().float()).abs().max().item()
        rows.append({"part": "elementwise", "kernel": name, "tokens": tokens, "fused_ms": f, "chain_ms": c,
                     "chain_over_fused": c / f, "fused_GB/s": moved / f / 1e6, "max_diff": err})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, action="append", default=None, help="decode attention batches (8, 32, 128)")
    ap.add_argument("--tokens", type=int, action="append", default=None,
                    help="rows of the elementwise kernels (8, 32, 128, 65536)")
    ap.add_argument("--cache-len", type=int, default=544, help="positions the cache is laid out for")
    ap.add_argument("--seen", type=int, default=528, help="positions a step attends over")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/layer_kernels.jsonl"))
    args = ap.parse_args(argv)
    if cuda_missing("layer_kernels.py"):
        return 2
    env = environment()
    for b in args.batch or [8, 32, 128]:
        att = attention_rows(b, args.cache_len, args.seen)
        ok = sorted((r for r in att if "ms" in r), key=lambda r: r["ms"])
        from flexoff.kernels import attention as A
        print(table(ok[:8] + [r for r in ok if r["variant"] in ("torch SDPA, head-major copy", f"b{A.BLOCK_T} t{A.TARGET_PROGRAMS} w{A.WARPS}")],
                    ["batch", "variant", "ms", "GB/s", "max_err"]), flush=True)
        write_jsonl(args.out, [{**r, **env} for r in att])
    ew = [r for n in args.tokens or (8, 32, 128, 65536) for r in elementwise_rows(n)]
    print(table(ew, ["kernel", "tokens", "fused_ms", "chain_ms", "chain_over_fused", "fused_GB/s", "max_diff"]))
    write_jsonl(args.out, [{**r, **env} for r in ew])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
