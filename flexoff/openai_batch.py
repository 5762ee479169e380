"""OpenAI batch files: the input of the OpenAI Batch API and `vllm run-batch`, and their output.

Knows: a batch input line (`custom_id`, `method` POST, `url` /v1/chat/completions or
/v1/completions, `body`), which body fields map to which request settings (OpenAI's defaults:
temperature 1, completions' max_tokens 16; vLLM's extra fields too), what a line may not ask
for (streaming, tools, echo, best_of other than n, several prompts in one line); and the
output line (`id`, `custom_id`, `response: {status_code, request_id, body}` with a
chat.completion or text_completion body and its usage, or `error: {code, message}` for a line
that could not be served, without stopping the job).
Does not know: generation (it maps to and from flexoff's requests and completions).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Mapping, Sequence

from flexoff import validate
from flexoff.errors import InputError

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
          "frequency_penalty", "user", "metadata", "store", "service_tier",
          # vLLM's extra sampling fields
          "top_k", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids"}
CHAT_ONLY = {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
TEXT_ONLY = {"prompt", "logprobs", "echo", "best_of", "suffix"}
RENAMED = {"max_completion_tokens": "max_tokens"}
DEFAULT_MAX_TOKENS = {TEXT: 16}  # OpenAI's; chat's is "up to the context", here the job's --max-new-tokens


def is_batch(first: Any) -> bool:
    """Whether a parsed first line is an OpenAI batch line."""
    return isinstance(first, Mapping) and "custom_id" in first and "body" in first


def to_request(line: Any, where: str) -> dict[str, Any]:
    """A flexoff request dict (id = custom_id, `_openai` = how to answer) for one batch line;
    InputError if the line cannot be served (its message goes into that line's error)."""
    if not isinstance(line, Mapping) or not isinstance(line.get("custom_id"), str) or not line["custom_id"]:
        raise InputError(f"{where}: a batch line needs a non-empty string custom_id")
    if line.get("method", "POST") != "POST":
        raise InputError(f"{where}: method must be POST")
    url, body = line.get("url"), line.get("body")
    if url not in (CHAT, TEXT):
        raise InputError(f"{where}: url must be {CHAT} or {TEXT}, got {url!r}")
    if not isinstance(body, Mapping):
        raise InputError(f"{where}: body must be a JSON object")
    allowed = COMMON | (CHAT_ONLY if url == CHAT else TEXT_ONLY)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InputError(f"{where}: body field {unknown[0]!r} is not supported")
    if body.get("stream"):
        raise InputError(f"{where}: streaming is not supported in batch files")
    if body.get("echo"):
        raise InputError(f"{where}: echo is not supported")
    if body.get("suffix"):
        raise InputError(f"{where}: suffix is not supported")
    if "best_of" in body and body["best_of"] != body.get("n", 1):
        raise InputError(f"{where}: best_of other than n is not supported")
    req: dict[str, Any] = {"id": line["custom_id"]}
    if url == CHAT:
        req["messages"] = body.get("messages")
        if body.get("logprobs"):
            req["logprobs"] = body.get("top_logprobs") or 0
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            raise InputError(f"{where}: one prompt per batch line (a string or a list of token ids)")
        req["prompt" if isinstance(prompt, str) else "prompt_ids"] = prompt
        if body.get("logprobs") is not None:
            req["logprobs"] = body["logprobs"]
    for key in COMMON - {"model", "user", "metadata", "store", "service_tier"}:
        if key in body:
            req[key] = body[key]
    for old, new in RENAMED.items():
        if old in body:
            req[new] = body[old]
    req.setdefault("temperature", 1.0)  # OpenAI's default
    if url in DEFAULT_MAX_TOKENS:
        req.setdefault("max_tokens", DEFAULT_MAX_TOKENS[url])
    out = validate.request(req, where)
    out["_openai"] = {"url": url, "model": body.get("model")}
    return out


def _id(prefix: str, key: str) -> str:
    return prefix + hashlib.sha1(key.encode()).hexdigest()[:24]


def answer(custom_id: str, url: str, model: str, comps: Sequence[Any], decode: Any) -> dict[str, Any]:
    """The output line of a served request: its samples as choices, and the usage."""
    created = int(time.time())
    usage = {"prompt_tokens": comps[0].prompt_tokens, "completion_tokens": sum(c.completion_tokens for c in comps)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if url == CHAT:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(c, decode), "finish_reason": c.finish_reason} for c in comps]
        body = {"id": _id("chatcmpl-", custom_id), "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    else:
        choices = [{"index": c.index, "text": c.text, "logprobs": _text_logprobs(c, decode),
                    "finish_reason": c.finish_reason} for c in comps]
        body = {"id": _id("cmpl-", custom_id), "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    return {"id": _id("batch_req_", custom_id), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _id("req_", custom_id), "body": body}, "error": None}


def refusal(custom_id: str, message: str) -> dict[str, Any]:
    """The output line of a request that could not be served."""
    return {"id": _id("batch_req_", custom_id), "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message}}


def _token(decode: Any, t: int) -> dict[str, Any]:
    s = decode([t])
    return {"token": s, "bytes": list(s.encode("utf-8"))}


def _chat_logprobs(c: Any, decode: Any) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    return {"content": [{**_token(decode, t), "logprob": lp,
                         "top_logprobs": [{**_token(decode, i), "logprob": v} for i, v in top]}
                        for t, lp, top in zip(c.token_ids, c.logprobs.chosen, c.logprobs.top)]}


def _text_logprobs(c: Any, decode: Any) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    tokens = [decode([t]) for t in c.token_ids]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": c.logprobs.chosen,
            "top_logprobs": [{decode([i]): v for i, v in top} for top in c.logprobs.top], "text_offset": offsets}
