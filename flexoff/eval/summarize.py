"""`flexoff eval summarize`: one table across the runs of a suite (Markdown and JSON).

Knows: where runs are (OUTPUT/runs/SUITE/*/stats.json) and which stats make the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flexoff.errors import InputError

COLUMNS = ["exact_match", "quasi_exact_match", "prefix_exact_match", "f1_score", "rouge_l", "perplexity",
           "bits_per_byte", "num_prompt_tokens", "num_output_tokens", "actual_throughput", "padded_throughput",
           "padding_efficiency"]


def summarize(output_path: str, suite: str) -> tuple[str, list[dict[str, Any]]]:
    root = Path(output_path) / "runs" / suite
    runs = sorted(p for p in root.glob("*/stats.json")) if root.exists() else []
    if not runs:
        raise InputError(f"no runs with stats.json under {root}")
    rows = []
    for path in runs:
        stats = {s["name"]["name"]: s for s in json.loads(path.read_text())}
        row: dict[str, Any] = {"run": path.parent.name,
                               "instances": stats["num_prompt_tokens"]["count"] if "num_prompt_tokens" in stats else 0}
        for c in COLUMNS:
            if c in stats:
                row[c] = stats[c]["mean"]
        rows.append(row)
    cols = ["run", "instances"] + [c for c in COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    md = "\n".join(lines) + "\n"
    (root / "summary.md").write_text(md)
    (root / "summary.json").write_text(json.dumps(rows, indent=2))
    return md, rows


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
