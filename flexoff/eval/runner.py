"""`flexoff eval run`: HELM runs (HELM's scenarios, adapters, metrics and files) on flexoff.

Knows: run entries as HELM writes them (description strings, `.conf` HOCON files), what flexoff
adds to them (`model=` must name the loaded model, `adapter=NAME` picks a LoRA adapter and is
taken out before HELM reads the entry), which values may become path parts under
`--output-path` (no `..`, separators or absolute paths), HELM's run-spec functions building the
run specs, HELM's `Runner` doing a run with `FlexoffExecutor` in place of its executor, the
efficiency stats added to each run's `stats.json`, and the closing table read back from it.
Does not know: how requests become flexoff requests (executor.py), HELM's model registry files
(helm_env.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from flexoff.errors import InputError
from flexoff.jobs import write_text_atomic
from flexoff.lock import OutputLock

# the closing table: instances, the first few of these a run has, throughput
METRICS = ("exact_match", "quasi_exact_match", "prefix_exact_match", "f1_score", "rouge_l", "f1_set_match",
           "iou_set_match", "exact_set_match", "bits_per_byte", "perplexity")
THROUGHPUT = ("actual_throughput", "padded_throughput")


@dataclass
class Entry:
    description: str  # as HELM reads it, model= set to the flexoff model's HELM name
    adapter: str | None  # a LoRA adapter's name (flexoff's own key), or None
    priority: int = 1
    groups: list[str] | None = None


def safe_part(value: str, what: str) -> str:
    """A value that becomes part of a path under --output-path: refused if it could leave it."""
    if not value or value == "." or ".." in value or "/" in value or "\\" in value or "\x00" in value:
        raise InputError(f"{what} {value!r}: path separators, '..' and absolute paths are not allowed")
    return value


def parse_entries(descriptions: list[str], confs: list[str], model: str, helm_model: str) -> list[Entry]:
    """Run entries from --run-entries and --conf-paths, checked and with model= filled in."""
    from helm.benchmark.presentation.run_entry import read_run_entries
    from helm.common.object_spec import parse_object_spec

    raw = [(d, 1, None) for d in descriptions]
    for c in confs:
        if not Path(c).is_file():
            raise InputError(f"--conf-paths {c}: no such file")
        try:
            raw += [(e.description, e.priority, e.groups) for e in read_run_entries([c]).entries]
        except Exception as e:  # pyhocon and dacite raise many kinds
            raise InputError(f"--conf-paths {c}: not a HELM run-entries file "
                             f"(entries: [{{description: ..., priority: 1}}]): {str(e).splitlines()[0]}") from None
    out = []
    for desc, priority, groups in raw:
        try:
            spec = parse_object_spec(desc)
        except Exception as e:
            raise InputError(f"run entry {desc!r}: {e}") from None
        args = dict(spec.args)
        named = args.pop("model", None)  # HELM's model names hold a '/'; it never becomes a path
        if named is not None and named not in (model, helm_model):
            raise InputError(f"run entry {desc!r}: model={named} is not the loaded model "
                             f"(--model {model}, in HELM {helm_model})")
        for k, v in args.items():
            if not (spec.class_name == "local_data" and k == "path"):  # its run name holds no path
                safe_part(str(v), f"run entry {desc!r}: {k}=")
        safe_part(spec.class_name, f"run entry {desc!r}: scenario")
        adapter = args.pop("adapter", None)
        args["model"] = helm_model
        text = spec.class_name + ":" + ",".join(f"{k}={v}" for k, v in args.items())
        out.append(Entry(text, adapter, priority, groups))
    return out


def run_specs(entries: list[Entry], max_eval_instances: int | None, num_train_trials: int | None) -> list[tuple[Any, str | None]]:
    """HELM's run specs for the entries (its own run-spec functions), each with its adapter."""
    from helm.benchmark.presentation.run_entry import RunEntry
    from helm.benchmark.run import run_entries_to_run_specs

    from flexoff.eval.local_data import LocalDataScenario  # importing it registers local_data with HELM

    out = []
    for e in entries:
        try:
            specs = run_entries_to_run_specs([RunEntry(e.description, e.priority, e.groups)],
                                             max_eval_instances=max_eval_instances, num_train_trials=num_train_trials)
        except Exception as x:  # an unknown scenario or argument, as HELM says it
            raise InputError(f"run entry {e.description!r}: {type(x).__name__}: {str(x).splitlines()[0]}") from None
        for s in specs:
            if s.scenario_spec.class_name.endswith(".LocalDataScenario"):  # read the file now: errors first
                LocalDataScenario(**s.scenario_spec.args).get_instances("")
            if e.adapter:
                s = replace(s, name=f"{s.name},adapter={e.adapter}")
            safe_part(s.name, "run name")
            out.append((s, e.adapter))
    return out


def make_runner(llm: Any, output_path: str, suite: str, local_path: str,
                on_progress: Callable[[str, int, int], None] | None = None) -> Any:
    """HELM's Runner, with flexoff executing every request of a run."""
    from helm.benchmark.executor import ExecutionSpec
    from helm.benchmark.runner import Runner

    from flexoff.eval.executor import FlexoffExecutor, efficiency

    class FlexoffRunner(Runner):
        adapter: str | None = None

        def run_one(self, run_spec: Any) -> None:
            folder = Path(self._get_run_path(run_spec))
            folder.mkdir(parents=True, exist_ok=True)
            self.executor.folder, self.executor.adapter = folder, self.adapter
            if on_progress:
                self.executor.on_progress = lambda done, total: on_progress(run_spec.name, done, total)
            with OutputLock(str(folder)):  # one writer per run folder
                super().run_one(run_spec)
                add_stats(folder / "stats.json", efficiency(folder))

    spec = ExecutionSpec(url=None, auth=None, local_path=local_path, parallelism=1)
    with contextlib.redirect_stdout(io.StringIO()):  # HELM prints where it looks for credentials
        runner = FlexoffRunner(spec, output_path, suite, skip_instances=False, cache_instances=False,
                               cache_instances_only=False, skip_completed_runs=False, exit_on_error=True)
    runner.executor = FlexoffExecutor(llm, spec, runner.executor.context)
    return runner


def run_suite(llm: Any, specs: list[tuple[Any, str | None]], output_path: str, suite: str, local_path: str,
              quiet: bool) -> list[str]:
    """Run every (run spec, adapter) with a progress bar each; returns what resumed runs reused.
    HELM's own failures (a scenario, a metric) become one-line errors; finished requests stay
    in the run's journal."""
    from tqdm import tqdm

    from flexoff.errors import FlexoffError

    bars: dict[str, Any] = {}

    def progress(run: str, done: int, total: int) -> None:
        bar = bars.get(run)
        if bar is None:
            bar = bars[run] = tqdm(total=total, desc=run[:60], unit="request", disable=quiet)
        bar.update(done - bar.n)

    runner, notes = make_runner(llm, output_path, suite, local_path, progress), []
    for spec, adapter in specs:
        runner.adapter = adapter
        try:
            runner.run_one(spec)
        except (FlexoffError, KeyboardInterrupt):
            raise
        except Exception as e:
            msg = (str(e).strip().splitlines() or [""])[0]
            raise FlexoffError(f"run {spec.name}: {type(e).__name__}: {msg}") from None
        finally:
            if spec.name in bars:
                bars[spec.name].close()
        if runner.executor.reused:
            notes.append(f"resumed {spec.name}: {runner.executor.reused} requests reused from its journal")
    return notes


def add_stats(path: Path, values: dict[str, float]) -> None:
    """Append flexoff's efficiency stats to a run's stats.json, as HELM Stats."""
    from helm.benchmark.metrics.statistic import Stat
    from helm.benchmark.metrics.metric_name import MetricName
    from helm.common.general import asdict_without_nones

    if not values or not path.exists():
        return
    stats = json.loads(path.read_text())
    stats = [s for s in stats if s["name"]["name"] not in values]
    stats += [asdict_without_nones(Stat(MetricName(k)).add(v)) for k, v in values.items()]
    write_text_atomic(path, json.dumps(stats, indent=2))


def closing_row(folder: Path) -> dict[str, float]:
    """The run's numbers from its stats.json, test split first, without perturbations."""
    stats = json.loads((folder / "stats.json").read_text())
    out: dict[str, float] = {}
    for split in ("test", "valid", None):
        for s in stats:
            n = s["name"]
            if not n.get("perturbation") and n.get("split") == split and n["name"] not in out and s.get("count"):
                out[n["name"]] = s["mean"]
    return out


def closing_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    """Instances, up to five metrics the runs have, and throughput, one line per run."""
    metrics = [m for m in METRICS if any(m in r for _, r in rows)][:5]
    cols = ["num_instances", *metrics, *THROUGHPUT]
    lines = [f"{'run':60} " + " ".join(f"{k[:14]:>14}" for k in cols)]
    for name, r in rows:
        lines.append(f"{name[:60]:60} " + " ".join(f"{r[k]:14.4g}" if k in r else f"{'-':>14}" for k in cols))
    return "\n".join(lines)


def quiet_helm(quiet: bool) -> None:
    """HELM logs every step; `quiet` keeps its warnings only."""
    logging.getLogger("helm").setLevel(logging.WARNING if quiet else logging.INFO)
