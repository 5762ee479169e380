"""Batch jobs on files: prompts JSONL in, completions JSONL out, resumable.

Knows: the prompts file format (one JSON object per line with `prompt`,
`messages` or `prompt_ids`, an optional `id` (default: the line number) and
optional per-line settings), the output file format, and resumption: results
are appended and flushed to disk block by block, a rerun skips ids already
answered, and a line cut short by a crash is dropped and redone.
Does not know: models or generation internals (it calls LLM.generate).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from flexoff import validate
from flexoff.errors import InputError
from flexoff.generation import group_json
from flexoff.lock import OutputLock


def read_prompts(path: str, chat: bool = False) -> list[dict[str, Any]]:
    """Parse and check the prompts file ('-' is stdin) before anything else runs."""
    name = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"prompts file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompts file {path}: {e}") from None
    out = []
    for n, raw in validate.read_jsonl(text, name):
        d = validate.request(raw, f"{name} line {n}")
        d["id"] = str(d.get("id", n))
        if chat and isinstance(d.get("prompt"), str):
            d["messages"] = [{"role": "user", "content": d.pop("prompt")}]
        d["_line"] = n
        out.append(d)
    if not out:
        raise InputError(f"{name} holds no prompts")
    return out


def answered_ids(path: str) -> set[str]:
    """Ids already in the output file. A last line cut short by a crash is removed;
    any other malformed line is an error (we do not append to a file we cannot read)."""
    p = Path(path)
    if path == "-" or not p.exists():
        return set()
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
    ids = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise InputError(f"output file {path} line {n} is not a flexoff result; "
                             "refusing to append to it (use another --output)") from None
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


def run_job(llm: Any, input_path: str, output_path: str, defaults: Any, chat: bool = False) -> JobResult:
    """Run every prompt of input_path not yet answered in output_path, holding the output's lock."""
    validate.output_file(output_path, "--output", input_path)
    with OutputLock(output_path):
        rows = read_prompts(input_path, chat)
        requests = llm.make_requests(rows, defaults)
        done = answered_ids(output_path)
        todo = [r for r in requests if r.id not in done]
        writer = ResultWriter(output_path)
        samples = {r.id: r.params.n for r in todo}
        pending: dict[str, list[Any]] = {}

        def on_block(comps: list[Any], _: Any) -> None:  # a request's line once all its samples are done
            lines = []
            for c in comps:
                group = pending.setdefault(c.id, [])
                group.append(c)
                if len(group) == samples[c.id]:
                    lines.append(group_json(sorted(pending.pop(c.id), key=lambda x: x.index)))
            writer.write(lines)

        try:
            out = llm.generate([], requests=todo, on_block=on_block)
        finally:
            writer.close()
    total = len({r.id for r in requests})
    return JobResult(total, total - len({r.id for r in todo}), out.stats)
