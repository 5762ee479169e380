"""Batch jobs on files: prompts JSONL in, completions JSONL out, resumable.

Knows: the prompts file format (one JSON object per line with `prompt`,
`messages` or `prompt_ids`, an optional `id` (default: the line number) and
optional per-line settings), the output file format, and resumption: results
are appended and flushed to disk block by block, a rerun skips ids already
answered, and a line cut short by a crash is dropped and redone; under torchrun, which
process writes what (a replica's shard, merged into the output).
Does not know: models or generation internals (it calls LLM.generate).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from flexoff import openai_batch, validate
from flexoff.errors import InputError
from flexoff.generation import group_json
from flexoff.lock import OutputLock
from flexoff.parallel import SHARD, shard_path


@dataclass
class Prompts:
    rows: list[dict[str, Any]]  # checked requests, in file order
    openai: bool = False  # an OpenAI batch file: answered in its output format
    refused: list[tuple[str, str]] = field(default_factory=list)  # OpenAI lines not served: (custom_id, why)


def read_prompts(path: str, chat: bool = False, input_format: str = "auto") -> Prompts:
    """Parse and check the prompts file ('-' is stdin) before anything else runs: flexoff's
    JSONL, or an OpenAI batch file (by its shape, or input_format="openai"), whose lines that
    cannot be served are kept as refusals rather than stopping the job."""
    name = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"prompts file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompts file {path}: {e}") from None
    lines = list(validate.read_jsonl(text, name))
    if not lines:
        raise InputError(f"{name} holds no prompts")
    openai = input_format == "openai" or (input_format == "auto" and openai_batch.is_batch(lines[0][1]))
    out = Prompts([], openai)
    seen: set[str] = set()
    for n, raw in lines:
        where = f"{name} line {n}"
        if openai:
            cid = raw.get("custom_id") if isinstance(raw, dict) else None
            if not isinstance(cid, str) or not cid:
                raise InputError(f"{where}: a batch line needs a non-empty string custom_id")
            if cid in seen:
                raise InputError(f"{where}: duplicate custom_id {cid!r}")
            seen.add(cid)
            try:
                d = openai_batch.to_request(raw, where)
            except InputError as e:
                out.refused.append((cid, str(e)))
                continue
        else:
            d = validate.request(raw, where)
            d["id"] = str(d.get("id", n))
        if chat and isinstance(d.get("prompt"), str):
            d["messages"] = [{"role": "user", "content": d.pop("prompt")}]
        d["_line"] = n
        out.rows.append(d)
    return out


def appended_records(path: str, what: str = "flexoff result",
                     hint: str = " (use another --output)") -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of a file ResultWriter appends to. A last line cut short by a crash
    is removed from the file (a complete one missing its newline gets it), so appending can go
    on; any other malformed line is an error (we do not append to a file we cannot read)."""
    p = Path(path)
    if path == "-" or not p.exists():
        return []
    data = p.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # bytes after the last newline: empty, or a cut-short line
    if tail:
        try:
            json.loads(tail)
            lines.append(tail)  # a complete last line missing only its newline
            with open(p, "ab") as f:
                f.write(b"\n")
        except (json.JSONDecodeError, UnicodeDecodeError):
            with open(p, "r+b") as f:
                f.truncate(len(data) - len(tail))
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            rec = None
        if not isinstance(rec, dict):
            raise InputError(f"output file {path} line {n} is not a {what}; refusing to append to it{hint}")
        out.append((n, rec))
    return out


def answered_ids(path: str) -> set[str]:
    """Ids already in the output file (see appended_records)."""
    ids = set()
    for n, rec in appended_records(path):
        rid = rec.get("custom_id", rec.get("id"))
        if rid is None:
            raise InputError(f"output file {path} line {n} is not a flexoff result; "
                             "refusing to append to it (use another --output)")
        ids.add(str(rid))
    return ids


class ResultWriter:
    """Appends completions as JSON lines, one flushed and fsynced write per block."""

    def __init__(self, path: str):
        self.path = path
        self._f: IO[str] | None = None

    def write(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if self.path == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        try:
            if self._f is None:
                self._f = open(self.path, "a", encoding="utf-8")
            self._f.write(text)
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:  # a full disk, say: one line, and a rerun resumes
            raise validate.write_error(self.path, e) from None

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:  # its error was raised by write already
                pass
            self._f = None


@dataclass
class JobResult:
    total: int
    skipped: int
    stats: Any


def run_job(llm: Any, input_path: str, output_path: str, defaults: Any, chat: bool = False,
            input_format: str = "auto", rider: Any = None) -> JobResult:
    """Run every prompt of input_path not yet answered in output_path, holding the output's lock.
    Under torchrun (llm.world) every process runs this: a replica's first stage writes its results
    (the output itself, or with several replicas its shard file, merged into the output at the end
    and at the start of a rerun); each replica answers the prompts it owns. `rider`: co-served
    finetuning (LLM.generate's; one process only)."""
    validate.output_file(output_path, "--output", input_path)
    world = getattr(llm, "world", None)
    if world is None or world.size == 1:
        with OutputLock(output_path):
            prompts = read_prompts(input_path, chat, input_format)
            return _answer(llm, prompts, output_path, answered_ids(output_path), defaults, rider=rider)
    if input_path == "-" or (output_path == "-" and world.replicas > 1):
        raise InputError("several processes read --input from a file and write --output to one; give both paths")
    prompts = read_prompts(input_path, chat, input_format)
    sharded = world.replicas > 1
    if sharded and world.rank == 0:  # a killed run's shards first
        _merge(output_path)
    world.barrier()
    path = shard_path(output_path, world) if sharded else output_path
    if world.leader:
        with OutputLock(path):
            done = world.broadcast(answered_ids(output_path) | (answered_ids(path) if sharded else set()))
            result = _answer(llm, prompts, path, done, defaults, world.owns)
    else:
        result = _answer(llm, prompts, None, world.broadcast(None), defaults, world.owns)
    world.barrier()
    if sharded and world.rank == 0:
        _merge(output_path)
    return result


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a file's text all at once: a temporary file beside it, fsync, rename (a kill
    leaves the old text or the new one, never part of either)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def merge_shards(output: str, done: set[str]) -> int:
    """Append to `output` the results in its replicas' shard files (any earlier run's too) whose
    ids it lacks (`done`: the ids it holds), fsync, then remove the shards. Returns lines added."""
    shards = sorted(Path(output).parent.glob(Path(output).name + SHARD + "*"))
    lines = []
    for p in shards:
        for _, rec in appended_records(str(p), hint="; move it away and rerun"):
            rid = str(rec.get("custom_id", rec.get("id")))
            if rid not in done:
                done.add(rid)
                lines.append(json.dumps(rec, ensure_ascii=False) + "\n")  # as ResultWriter wrote it
    if lines:
        with open(output, "a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
    for p in shards:
        p.unlink()
    return len(lines)


def _merge(output_path: str) -> None:
    """The replicas' shard files into the output, under its lock."""
    with OutputLock(output_path):
        merge_shards(output_path, answered_ids(output_path))


def _answer(llm: Any, prompts: Prompts, path: str | None, done: set[str], defaults: Any,
            owns: Callable[[str], bool] = lambda rid: True, rider: Any = None) -> JobResult:
    """Answer the prompts `owns` picks that are not `done`, appending to `path` (None: nowhere)."""
    writer = ResultWriter(path) if path is not None else None
    write = writer.write if writer is not None else (lambda records: None)
    try:
        refused = [(cid, why) for cid, why in prompts.refused if cid not in done and owns(cid)]
        if prompts.openai:  # a line that cannot be served is answered with its error; the job goes on
            requests = []
            for row in prompts.rows:
                try:
                    requests += llm.make_requests([row], defaults)
                except InputError as e:
                    if row["id"] not in done and owns(row["id"]):
                        refused.append((row["id"], str(e)))
            write([openai_batch.refusal(cid, why) for cid, why in refused])
        else:
            requests = llm.make_requests(prompts.rows, defaults)
        todo = [r for r in requests if r.id not in done and owns(r.id)]
        meta = {r["id"]: r.get("_openai") for r in prompts.rows}
        samples = {r.id: r.params.n for r in todo}
        pending: dict[str, list[Any]] = {}

        def line(group: list[Any]) -> dict[str, Any]:
            m = meta[group[0].id]
            if m is None:
                return group_json(group)
            return openai_batch.answer(group[0].id, m["url"], m["model"] or llm.model.name, group,
                                       llm.tokenizer.decode)

        def on_block(comps: list[Any], _: Any) -> None:  # a request's line once all its samples are done
            lines = []
            for c in comps:
                group = pending.setdefault(c.id, [])
                group.append(c)
                if len(group) == samples[c.id]:
                    lines.append(line(sorted(pending.pop(c.id), key=lambda x: x.index)))
            write(lines)

        out = llm.generate([], requests=todo, on_block=on_block, rider=rider)
    finally:
        if writer is not None:
            writer.close()
    ids = [r["id"] for r in prompts.rows] + [cid for cid, _ in prompts.refused]
    return JobResult(len(ids), sum(1 for i in ids if i in done), out.stats)
