"""Recorded runs against the current cost model: measured over predicted, then and now.

Knows: reading throughput.py's JSON records (policy, workload, measured throughput and decode
time), predicting each again with today's cost model and a hardware profile, and printing
both ratios, so a change to the cost model is checked offline against real runs before it
is measured again on the device. Writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table, write_jsonl  # noqa: E402
from throughput import predict  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, nargs="+")
    ap.add_argument("--hardware", default="benchmarks/data/h200-measured.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from flexoff.checkpoint import load_model
    from flexoff.policy import hardware
    from flexoff.policy.cost_model import Workload
    from flexoff.policy.policy import Policy

    hw = hardware.load(args.hardware)
    rows: list[dict[str, Any]] = []
    for path in args.records:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "policy_json" not in r:
                continue
            spec = load_model(r["model"]).spec
            p = Policy.from_dict(r["policy_json"])
            pred = predict(spec, hw, p, Workload(r["prompt_len"], r["gen_len"], 2, r.get("num_prompts")))
            rows.append({"record": path.name, "label": r["label"], "policy": p.describe(),
                         "decode_s": r["decode_s"], "predicted_decode_s_then": r["predicted_decode_s"],
                         "predicted_decode_s_now": pred.decode_s,
                         "measured/predicted_then": r["measured/predicted"],
                         "measured/predicted_now": r["gen_tok_s"] / pred.throughput,
                         "bottleneck_now": pred.bottleneck})
    cols = ["record", "label", "decode_s", "predicted_decode_s_then", "predicted_decode_s_now",
            "measured/predicted_then", "measured/predicted_now", "bottleneck_now"]
    print(table(rows, cols))
    if args.out:
        write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
