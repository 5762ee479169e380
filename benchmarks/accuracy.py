"""What 4-bit compression costs in accuracy: SmolLM2-135M perplexity on an English text, dense and
with flexoff's compressed weights or KV cache, against a plain torch fake-quantization reference
(transformers on the same weights, quantized and dequantized in float32) at the same settings.

    python benchmarks/accuracy.py [--text benchmarks/data/lighthouse.txt] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch

from common import environment, table, write_jsonl

HERE = Path(__file__).resolve().parent


def fake_quant(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """A plain float32 fake quantization: 4-bit, asymmetric, groups along dim."""
    y = x.float().movedim(dim, -1)
    g = y.reshape(*y.shape[:-1], -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo) / scale).round().clamp(0, 15)
    return (q * scale + lo).reshape(y.shape).movedim(-1, dim).to(x.dtype)


def hf_ppl(model, ids: list[int], window: int = 512) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), window):
            w = torch.tensor([ids[i:i + window]])
            if w.shape[1] < 2:
                continue
            lp = model(w).logits[0, :-1].double().log_softmax(-1)
            nll -= float(lp.gather(-1, w[0, 1:, None]).sum())
            count += w.shape[1] - 1
    return math.exp(nll / count)


def fake_quant_weights(model):
    """A copy with every Linear weight fake-quantized along output channels (group 64)."""
    m = copy.deepcopy(model)
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.clone())
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(fake_quant(mod.weight, 64, 0))
    return m


def fake_quant_cache(model):
    """A copy whose attention sees keys (after RoPE) and values fake-quantized along the head dim."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fq_attention(module, q, k, v, mask, **kw):
        return sdpa_attention_forward(module, q, fake_quant(k, 64, -1), fake_quant(v, 64, -1), mask, **kw)

    AttentionInterface.register("flexoff_fake_quant_kv", fq_attention)
    m = copy.deepcopy(model)
    m.set_attn_implementation("flexoff_fake_quant_kv")
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=HERE / "data" / "lighthouse.txt")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from flexoff import LLM, Policy
    from flexoff.checkpoint import smollm2_folder
    from flexoff.ppl import perplexity

    text = args.text.read_text()
    llm = LLM("smollm2", device="cpu", dtype="float32")
    ids = llm.tokenizer.encode(text)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_folder()), dtype=torch.float32).eval()
    refs = {"dense": hf, "4-bit weights": fake_quant_weights(hf), "4-bit KV cache": fake_quant_cache(hf)}
    policies = {"dense": Policy(gpu_batch_size=8), "4-bit weights": Policy(gpu_batch_size=8, compress_weight=True),
                "4-bit KV cache": Policy(gpu_batch_size=8, compress_cache=True)}
    rows = []
    for mode, pol in policies.items():
        llm.policy_arg = pol
        r = perplexity(llm, text)
        ref = hf_ppl(refs[mode], ids)
        rows.append({"mode": mode, "flexoff_ppl": r.value, "reference_ppl": ref, "flexoff/reference": r.value / ref,
                     "tokens": r.tokens, "windows": r.windows, "window": r.window})
    llm.close()
    dense = rows[0]["flexoff_ppl"]
    for r in rows:
        r["vs_dense"] = r["flexoff_ppl"] / dense
    print(f"SmolLM2-135M, {args.text.name}: {rows[0]['tokens']} tokens in {rows[0]['windows']} windows of "
          f"{rows[0]['window']}, float32 on the CPU; compression: 4 bits, groups of 64")
    print(table(rows, ["mode", "flexoff_ppl", "reference_ppl", "flexoff/reference", "vs_dense"]))
    write_jsonl(args.out / "accuracy.jsonl", [{**environment(), "text": str(args.text.name), **r} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
