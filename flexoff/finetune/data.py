"""Training examples: token ids and which of them carry loss.

Knows: the three line shapes (`text`: loss on every token after the first; `prompt` +
`completion`: loss on the completion only; `messages`: a chat through the model's template, loss
on the assistant turns only, found by rendering the chat up to each turn), truncation to a
maximum length, and one-line errors naming the file, line and field.
Does not know: batching, models beyond their tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flexoff import validate
from flexoff.errors import InputError


@dataclass
class Example:
    ids: list[int]
    loss: list[bool]  # per token: whether predicting it counts (the first token never does)


def to_example(d: Any, tokenizer: Any, where: str, max_len: int) -> Example:
    if not isinstance(d, Mapping):
        raise InputError(f"{where}: expected a JSON object with 'text', 'prompt' and 'completion', or 'messages'")
    keys = [k for k in ("text", "prompt", "messages") if k in d]
    unknown = sorted(set(d) - {"text", "prompt", "completion", "messages", "id"})
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r}")
    if len(keys) != 1 or ("prompt" in d) != ("completion" in d):
        raise InputError(f"{where}: give 'text', or 'prompt' and 'completion', or 'messages'")
    if "text" in d:
        if not isinstance(d["text"], str) or not d["text"].strip():
            raise InputError(f"{where}: 'text' must be a non-empty string")
        ids = tokenizer.encode(d["text"])
        loss = [True] * len(ids)
    elif "prompt" in d:
        if not all(isinstance(d[k], str) and d[k] for k in ("prompt", "completion")):
            raise InputError(f"{where}: 'prompt' and 'completion' must be non-empty strings")
        p = tokenizer.encode(d["prompt"])
        ids = tokenizer.encode(d["prompt"] + d["completion"])
        if ids[:len(p)] != p:  # the completion merged with the prompt's last token: split at the text
            ids = p + tokenizer.encode(d["completion"])
        loss = [False] * len(p) + [True] * (len(ids) - len(p))
    else:
        msgs = d["messages"]
        validate.request({"messages": msgs}, where)
        ids, loss = [], []
        for n, m in enumerate(msgs):
            upto = tokenizer.chat(msgs[:n + 1], generation_prompt=False)
            new = upto[len(ids):] if upto[:len(ids)] == ids else upto
            if upto[:len(ids)] != ids:
                raise InputError(f"{where}: the chat template does not render turn by turn")
            ids = upto
            loss += [m["role"] == "assistant"] * len(new)
        if not any(loss):
            raise InputError(f"{where}: no assistant turn to learn from")
    ids, loss = ids[:max_len], loss[:max_len]
    loss[0] = False  # nothing predicts the first token
    if len(ids) < 2 or not any(loss):
        raise InputError(f"{where}: nothing left to learn from after truncation to {max_len} tokens")
    return Example(ids, loss)


def read_examples(path: str, tokenizer: Any, max_len: int) -> list[Example]:
    """Every example of a JSONL file, checked before training starts."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"training data {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read training data {path}: {e}") from None
    out = [to_example(d, tokenizer, f"{path} line {n}", max_len) for n, d in validate.read_jsonl(text, path)]
    if not out:
        raise InputError(f"{path} holds no examples")
    return out
