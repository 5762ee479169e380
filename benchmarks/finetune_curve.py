"""Loss curves of LoRA finetuning on a 16-bit base against the same base compressed to 4 bits
(QLoRA-style, `--compress-weight`): the same model, adapter initialisation, data and order.

Knows: cutting a text file into training and held-out windows of about `--chars` characters
(every `--eval-every`-th window held out), training one fresh adapter per base with
`LLM.finetune` for `--steps` steps, and the training loss of every step and the held-out loss
at every checkpoint. Prints the curves side by side and writes one JSON record per base.
Runs on the GPU or the CPU (float32 there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, table, write_jsonl  # noqa: E402


def windows(text: str, chars: int) -> list[str]:
    """Consecutive pieces of about `chars` characters, cut at spaces."""
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + chars)
        cut = text.rfind(" ", start + chars // 2, end) if end < len(text) else end
        end = cut if cut > start else end
        out.append(text[start:end].strip())
        start = end
    return [w for w in out if w]


def curve(args: argparse.Namespace, compress: bool, train: list[dict[str, str]], held: list[dict[str, str]]) -> dict[str, Any]:
    from flexoff import LLM, Policy
    from flexoff.finetune.trainer import TrainConfig

    policy = Policy(gpu_batch_size=args.batch, compress_weight=compress)
    with LLM(args.model, policy=policy, device=args.device) as llm, tempfile.TemporaryDirectory() as out:
        losses = llm.finetune(train, out, {"r": args.rank, "lora_alpha": 2 * args.rank,
                                           "target_modules": args.targets.split(",")},
                              steps=args.steps, config=TrainConfig(lr=args.lr, batch_size=args.batch, warmup=2,
                                                                   schedule="cosine"),
                              eval_data=held, save_every=args.save_every, seed=args.seed)
        metrics = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"base": "4-bit" if compress else "16-bit", "losses": losses,
            "eval": {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default=str(Path(__file__).parent / "data" / "lighthouse.txt"))
    ap.add_argument("--chars", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=5, help="every n-th window is held out")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/finetune_curve.jsonl"))
    args = ap.parse_args(argv)
    pieces = windows(Path(args.text).read_text(encoding="utf-8"), args.chars)
    held = [{"text": w} for i, w in enumerate(pieces) if i % args.eval_every == args.eval_every - 1]
    train = [{"text": w} for i, w in enumerate(pieces) if i % args.eval_every != args.eval_every - 1]
    torch.manual_seed(args.seed)
    runs = [curve(args, False, train, held), curve(args, True, train, held)]
    env = environment()
    rows = []
    for step in range(args.steps):
        row: dict[str, Any] = {"step": step + 1}
        for r in runs:
            row[f"loss {r['base']}"] = r["losses"][step]
            if step + 1 in r["eval"]:
                row[f"held-out {r['base']}"] = r["eval"][step + 1]
        rows.append(row)
    print(f"{len(train)} training and {len(held)} held-out windows of {args.text}")
    print(table(rows, ["step", "loss 16-bit", "loss 4-bit", "held-out 16-bit", "held-out 4-bit"]))
    write_jsonl(args.out, [{**r, "model": args.model, "steps": args.steps, "batch": args.batch, "rank": args.rank,
                            "lr": args.lr, "train_windows": len(train), "held_out_windows": len(held), **env}
                           for r in runs])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
