"""Soak test of resumption: a long job killed with SIGKILL at random points and rerun each time
ends with every id exactly once and the same completions as an uninterrupted run.

Knows: running `flexoff run` as a real process on a dummy model, killing it after a random
delay (drawn between the first written line and the expected end), rerunning the same command
until it exits 0, and comparing the output with an uninterrupted run's, line by line by id.
Prints a table and writes JSON. Not in CI (minutes): `python benchmarks/soak.py`.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, table, write_jsonl  # noqa: E402


def command(model: str, inp: Path, out: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "flexoff.cli", "run", "--model", model, "-q", "--input", str(inp), "--output",
            str(out), "--max-new-tokens", str(args.max_new_tokens), "--gpu-batch-size", str(args.gpu_batch_size),
            "--temperature", "0.7", "--seed", "3"]


def lines_by_id(path: Path) -> tuple[dict[str, str], int]:
    rows = [l for l in path.read_text(encoding="utf-8").split("\n") if l]
    return {json.loads(l)["id"]: l for l in rows}, len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:opt-tiny")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--gpu-batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/soak.jsonl"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="flexoff-soak-"))
    inp = work / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"prompt number {i}: " + "x" * (i % 37)}) + "\n"
                           for i in range(args.prompts)))
    ref_out = work / "reference.jsonl"
    proc = subprocess.Popen(command(args.model, inp, ref_out, args))
    while proc.poll() is None and not ref_out.exists():
        time.sleep(0.01)
    t0 = time.perf_counter()  # the job's own time, from its first block on
    if proc.wait() != 0:
        raise SystemExit("the uninterrupted run failed")
    full_s = time.perf_counter() - t0
    out = work / "killed.jsonl"
    kills, runs = [], 0
    while True:
        runs += 1
        before = lines_by_id(out)[1] if out.exists() else 0
        proc = subprocess.Popen(command(args.model, inp, out, args), stderr=subprocess.PIPE, text=True)
        if len(kills) < args.kills:  # once this run writes, kill it at a random point of what is left
            while proc.poll() is None and (lines_by_id(out)[1] if out.exists() else 0) <= before:
                time.sleep(0.01)
            left = full_s * (1 - before / args.prompts)
            delay = rng.uniform(0, left / (args.kills - len(kills) + 1))
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills.append({"run": runs, "after_first_line_s": round(delay, 2), "lines_before": before,
                              "lines_at_kill": lines_by_id(out)[1]})
                continue
        if proc.wait() != 0:
            raise SystemExit(f"run {runs} failed: {proc.stderr.read()}")
        break
    ref, _ = lines_by_id(ref_out)
    got, n_lines = lines_by_id(out)
    rec = {"prompts": args.prompts, "kills": len(kills), "runs": runs, "lines": n_lines, "ids": len(got),
           "every_id_once": n_lines == len(got) == len(ref) and set(got) == set(ref),
           "identical_to_uninterrupted": got == ref, "uninterrupted_s": round(full_s, 1), "kill_points": kills,
           "model": args.model, **environment()}
    print(table(kills, ["run", "after_first_line_s", "lines_before", "lines_at_kill"]))
    print(table([rec], ["prompts", "kills", "runs", "lines", "ids", "every_id_once", "identical_to_uninterrupted"]))
    write_jsonl(args.out, [rec])
    return 0 if rec["every_id_once"] and rec["identical_to_uninterrupted"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
