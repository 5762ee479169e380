"""Every input a user gives, checked in one place before a model loads.

Knows: JSONL as the format defines it (lines end at "\\n" only; a "\\r" before it and a leading
byte-order mark are tolerated; NaN and Infinity are not JSON); the schema of a request line
(the JSONL prompts file and the Python API's dicts: exactly one of `prompt`, `messages` or
`prompt_ids`, an `id`, and generation settings of the right type and range, no other keys);
model config sizes; output paths (writable, not a folder, not the input); and how to say what
was wrong in one line that names the file, line and field.
Does not know: models (token ids are checked against the vocabulary once it is known),
generation, files' contents beyond their schema.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

from flexoff.errors import FlexoffError, InputError, ModelError
from flexoff.sampling import FIELDS, SamplingParams

PROMPT_KEYS = ("prompt", "messages", "prompt_ids")
SETTING_KEYS = FIELDS
ALIASES = {"max_tokens": "max_new_tokens", "prompt_token_ids": "prompt_ids"}  # the OpenAI and vLLM names
REQUEST_KEYS = frozenset(("id", "adapter") + PROMPT_KEYS + SETTING_KEYS + tuple(ALIASES))
MAX_SEED = 2**63 - 1


# ---- JSON and JSONL --------------------------------------------------------------------------
def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str | bytes) -> Any:
    """json.loads without NaN, Infinity and -Infinity (Python's json reads them; JSON has none)."""
    return json.loads(text, parse_constant=_no_constant)


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a JSONL text: split at "\\n" only (U+2028, U+2029 and U+0085 are
    characters inside strings, not line ends), a "\\r" before it dropped, a leading BOM dropped."""
    if text.startswith("\ufeff"):
        text = text[1:]
    for n, line in enumerate(text.split("\n"), 1):
        yield n, line[:-1] if line.endswith("\r") else line


def read_jsonl(text: str, name: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line; a line that is not JSON is an InputError."""
    for n, line in jsonl_lines(text):
        if not line.strip():
            continue
        try:
            yield n, loads(line)
        except (json.JSONDecodeError, ValueError) as e:
            raise InputError(f"{name} line {n}: not valid JSON ({getattr(e, 'msg', e)})") from None


# ---- request lines ---------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def request(d: Any, where: str) -> dict[str, Any]:
    """A checked copy of one request (a JSONL line or an API dict): unknown keys, contradictions,
    wrong types and out-of-range values are an InputError naming `where` and the field. Aliases
    become their names (`max_tokens` -> `max_new_tokens`)."""
    if not isinstance(d, Mapping):
        raise InputError(f"{where}: expected a JSON object with 'prompt', 'messages' or 'prompt_ids'")
    unknown = sorted(k for k in d if k not in REQUEST_KEYS and not k.startswith("_"))
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(sorted(REQUEST_KEYS))}")
    out = dict(d)
    for alias, name in ALIASES.items():
        if alias in out:
            if name in out:
                raise InputError(f"{where}: give {name!r} or {alias!r}, not both")
            out[name] = out.pop(alias)
    given = [k for k in PROMPT_KEYS if k in out]
    if len(given) != 1:
        raise InputError(f"{where}: give exactly one of 'prompt', 'messages' or 'prompt_ids'"
                         + (f" (got {', '.join(given)})" if given else ""))
    _check_prompt(out, given[0], where)
    if "id" in out and (not isinstance(out["id"], (str, int)) or isinstance(out["id"], bool)):
        raise InputError(f"{where}: 'id' must be a string or an integer")
    if out.get("adapter") is not None and (not isinstance(out["adapter"], str) or not out["adapter"]):
        raise InputError(f"{where}: 'adapter' must be an adapter's name")
    _check_settings(out, where)
    return out


def _check_prompt(d: dict[str, Any], key: str, where: str) -> None:
    v = d[key]
    if key == "prompt" and isinstance(v, list):  # the API's shorthands: ids, or a chat
        key = "messages" if v and isinstance(v[0], dict) else "prompt_ids"
    if key == "prompt":
        if not isinstance(v, str):
            raise InputError(f"{where}: 'prompt' must be a string (or use 'messages' or 'prompt_ids')")
        if not v.strip():
            raise InputError(f"{where}: the prompt is empty")
    elif key == "messages":
        if not isinstance(v, list) or not v:
            raise InputError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for m in v:
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str) or set(m) - {"role", "content", "name"}:
                raise InputError(f"{where}: each message must be {{\"role\": string, \"content\": string}}")
    elif not isinstance(v, list) or not v or not all(_is_int(i) and i >= 0 for i in v):
        raise InputError(f"{where}: 'prompt_ids' must be a non-empty list of non-negative integer token ids")


def _check_settings(d: dict[str, Any], where: str) -> None:
    """The settings are what SamplingParams accepts (its checks are the one definition)."""
    try:
        SamplingParams(**{k: d[k] for k in SETTING_KEYS if k in d})
    except InputError as e:
        raise InputError(f"{where}: {e}") from None


# ---- sizes -----------------------------------------------------------------------------------
SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
              "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_BYTES = 2**60  # an exbibyte: more than any machine we plan for


def size(text: str | int | None) -> int | None:
    """'16GiB', '500MB', '2e9' or an int -> bytes; None stays None."""
    if text is None:
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        n = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in SIZE_UNITS:
            raise InputError(f"{text!r} is not a size; use e.g. 16GiB, 500MB or a number of bytes")
        n = float(m.group(1)) * SIZE_UNITS[m.group(2).lower()]
    if not math.isfinite(n) or not 0 <= n <= MAX_BYTES:
        raise InputError(f"{text!r} is not a size from 0 to 1 EiB")
    return int(n)


# ---- model configs ---------------------------------------------------------------------------
def fraction(text: str, what: str) -> float:
    """A share such as 10% or 0.1, above 0: the fraction (one-line error otherwise)."""
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise InputError(f"{what} {text!r}: give a share above 0, such as 10% or 0.1")
    return v


def config_sizes(config: Mapping[str, Any], keys: tuple[str, ...], where: str = "config.json") -> None:
    """The config's sizes that are present must be positive integers."""
    for k in keys:
        if k in config and config[k] is not None and not (_is_int(config[k]) and config[k] > 0):
            raise ModelError(f"{where}: {k} must be a positive integer, got {config[k]!r}")


def config_numbers(config: Mapping[str, Any], keys: tuple[str, ...], where: str = "config.json") -> None:
    """The config's real-valued settings that are present must be finite positive numbers."""
    for k in keys:
        if k in config and config[k] is not None and not (_is_number(config[k]) and config[k] > 0):
            raise ModelError(f"{where}: {k} must be a positive number, got {config[k]!r}")


# ---- output paths ----------------------------------------------------------------------------
def output_file(path: str, what: str = "--output", input_path: str | None = None) -> None:
    """A file we may create or append to: not a folder, its folder exists and is writable, and
    not the input file."""
    if path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{what} {path} is a folder; give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{what} {path}: the folder {parent} does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise InputError(f"{what} {path} is not writable")
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{what} {path}: cannot create files in {parent}")
    if input_path and input_path != "-" and Path(input_path).exists() and p.exists() \
            and os.path.samefile(p, input_path):
        raise InputError(f"{what} {path} is the input file; give another output path")


def output_folder(path: str, what: str = "--output-path") -> None:
    """A folder we may create and write in."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"{what} {path} exists and is not a folder")
    probe = p
    while not probe.exists():
        probe = probe.parent if str(probe.parent) != str(probe) else Path(".")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"{what} {path}: cannot write in {probe}")


def write_error(path: str, err: OSError) -> FlexoffError:
    """An OSError while writing results, as a one-line error that says nothing was lost."""
    return InputError(f"cannot write to {path}: {err.strerror or err}; what was written before is kept, "
                      "and a rerun resumes from it")
