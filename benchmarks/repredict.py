"""Recorded runs against the current cost model: measured over predicted, then and now.

Knows: reading throughput.py's JSON records (policy, workload, measured throughput and decode
time), predicting each again with today's cost model and a hardware profile (one for all, or
each run's own beside its record), optionally at the link rate the run measured, and printing
the ratios, so a change to the cost model is checked offline against real runs before it
is measured again on the device; `--set FIELD=VALUE` prices them as if the profiles had read
that rate. Writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import functools
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
    ap.add_argument("--own-profile", action="store_true",
                    help="price each record with profile-COMMIT.json beside it (its run's commit), where there is "
                         "one, and CPU attention at the rate the run was priced with (priced_cpu_attn_bdw), where "
                         "recorded")
    ap.add_argument("--own-link", action="store_true",
                    help="also price decode's copies at the link rate the run itself measured (decode_link_GBps)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                    help="a profile field to price with instead of the profile's (every profile), e.g. "
                         "host_read_bdw=97e9: what a rate the profile lacks or misread would change")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from dataclasses import asdict, replace

    from flexoff.checkpoint import load_model
    from flexoff.errors import FlexoffError
    from flexoff.policy import hardware
    from flexoff.policy.calibration import at_cpu_attention
    from flexoff.policy.cost_model import Workload
    from flexoff.policy.policy import Policy

    try:
        overrides = parse_overrides(args.overrides)

        def load(name: str) -> hardware.Hardware:
            hw = hardware.load(name)
            return hardware.Hardware.from_dict({**asdict(hw), **overrides}) if overrides else hw

        default = load(args.hardware)
    except FlexoffError as e:
        print(f"repredict.py: {e}", file=sys.stderr)
        return 2
    profiles = functools.cache(load)  # each file read once
    specs = functools.cache(lambda name: load_model(name).spec)
    rows: list[dict[str, Any]] = []
    for path in args.records:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "policy_json" not in r or r.get("kind") == "warm-up":
                continue
            own = path.parent / f"profile-{str(r.get('commit', '')).removesuffix('+wip')}.json"
            hw = profiles(str(own)) if args.own_profile and own.is_file() else default
            if args.own_profile and r.get("priced_cpu_attn_bdw"):  # the rate the run planned with
                hw = at_cpu_attention(hw, r["priced_cpu_attn_bdw"])
            spec = specs(r["model"])
            p = Policy.from_dict(r["policy_json"])
            work = Workload(r["prompt_len"], r["gen_len"], 2, r.get("num_prompts"))
            pred = predict(spec, hw, p, work)
            row = {"record": path.name, "label": r["label"], "policy": p.describe(), "profile": hw.name
                   if hw is default else own.name, "decode_s": r["decode_s"],
                   "predicted_decode_s_then": r["predicted_decode_s"], "predicted_decode_s_now": pred.decode_s,
                   "measured/predicted_then": r["measured/predicted"],
                   "measured/predicted_now": r["gen_tok_s"] / pred.throughput, "bottleneck_now": pred.bottleneck}
            if args.own_link and r.get("decode_link_GBps"):
                at = predict(spec, replace(hw, decode_ctog_bdw=r["decode_link_GBps"] * 1e9), p, work)
                row.update({"predicted_decode_s_own_link": at.decode_s,
                            "decode/predicted_own_link": r["decode_s"] / at.decode_s})
            rows.append(row)
    cols = ["record", "label", "decode_s", "predicted_decode_s_then", "predicted_decode_s_now",
            "measured/predicted_then", "measured/predicted_now", "bottleneck_now"]
    if args.own_link:
        cols += ["predicted_decode_s_own_link", "decode/predicted_own_link"]
    print(table(rows, cols))
    if args.out:
        write_jsonl(args.out, rows)
    return 0


def parse_overrides(items: list[str]) -> dict[str, float]:
    """--set FIELD=VALUE items as profile fields and numbers; a field the profile has no rate
    for, or a value that is not a number, is an error."""
    from dataclasses import fields

    from flexoff.errors import FlexoffError
    from flexoff.policy.hardware import Hardware

    rates = {f.name for f in fields(Hardware) if f.type in ("float", float)}
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in rates:
            raise FlexoffError(f"--set {item!r}: {name!r} is not a rate of a hardware profile")
        try:
            out[name] = float(value)
        except ValueError:
            raise FlexoffError(f"--set {item!r}: {value!r} is not a number") from None
    return out


if __name__ == "__main__":
    raise SystemExit(main())
