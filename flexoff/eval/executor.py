"""flexoff as HELM's model: a batched offline executor, and a tokenizer HELM's adapters can use.

Knows: how a HELM `Request` maps onto a flexoff request (prompt text, max_tokens, temperature,
top_p, stop sequences, num_completions, penalties, echo_prompt for language modeling) and how
a flexoff completion maps back onto HELM's `RequestResult` (tokens with log-probabilities,
finish_reason as {"reason": ...}); that every request of a run goes through one
`LLM.generate` call, which groups prompts by length into the block engine's blocks; the run's
journal (results appended and fsynced block by block, keyed by the request's content, so a
rerun reuses them); and the efficiency of each block (padded vs actual tokens) for the run's
closing stats.
Does not know: scenarios, adapters or metrics (HELM's own code does those).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from helm.benchmark.adaptation.request_state import RequestState
from helm.benchmark.adaptation.scenario_state import ScenarioState
from helm.clients.client import Client
from helm.common.codec import from_json
from helm.common.general import asdict_without_nones
from helm.common.request import GeneratedOutput, Request, RequestResult, Token
from helm.common.tokenization_request import (DecodeRequest, DecodeRequestResult, TokenizationRequest,
                                              TokenizationRequestResult, TokenizationToken)
from helm.tokenizers.tokenizer import Tokenizer

from flexoff.eval.helm_env import TOKENIZERS
from flexoff.jobs import ResultWriter, appended_records

JOURNAL = "flexoff_requests.jsonl"  # in the run folder: finished requests' results
EFFICIENCY = "flexoff_efficiency.jsonl"  # in the run folder: one line per block
EFFICIENCY_RECORD = "flexoff efficiency record"
BLOCK_FIELDS = ("prompt_tokens", "generated_tokens", "padded_prompt_tokens", "padded_generated_tokens",
                "prefill_s", "decode_s")


class FlexoffTokenizer(Tokenizer):
    """The loaded model's own tokenizer, under its HELM name (window services count and cut
    prompts with it, so truncation agrees with what the engine is given)."""

    def __init__(self, tokenizer_name: str):
        self.name = tokenizer_name

    def _tok(self, name: str) -> Any:
        if name not in TOKENIZERS:
            raise RuntimeError(f"{name} is served by `flexoff eval run` only (its model is not loaded here)")
        return TOKENIZERS[name]

    def tokenize(self, request: TokenizationRequest) -> TokenizationRequestResult:
        tok = self._tok(request.tokenizer)
        ids = tok.encode(request.text)
        if request.truncation:
            ids = ids[:request.max_length]
        values: list[Any] = list(ids) if request.encode else [tok.decode([i]) for i in ids]
        return TokenizationRequestResult(success=True, cached=False, text=request.text,
                                         tokens=[TokenizationToken(v) for v in values])

    def decode(self, request: DecodeRequest) -> DecodeRequestResult:
        return DecodeRequestResult(success=True, cached=False, text=self._tok(request.tokenizer).decode(request.tokens))


class OfflineOnlyClient(Client):
    """The deployment's client for `helm-run`: flexoff models run through `flexoff eval run`."""

    def make_request(self, request: Request) -> RequestResult:
        raise RuntimeError(f"{request.model_deployment} runs offline: use `flexoff eval run`, not helm-run")


def request_key(request: Request, adapter: str | None = None) -> str:
    """A request's identity: the hash of all its fields and the adapter (a rerun's identical
    request reuses its result)."""
    d = {**asdict_without_nones(request), "flexoff_adapter": adapter}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:32]


def flexoff_request(key: str, r: Request) -> dict[str, Any]:
    """The flexoff request (a JSONL-style dict) for a HELM request."""
    if r.messages or r.multimodal_prompt is not None or r.embedding:
        raise ValueError("flexoff serves text completion requests only (no chat messages, media or embeddings)")
    out: dict[str, Any] = {"id": key, "prompt": r.prompt, "max_new_tokens": r.max_tokens,
                           "temperature": r.temperature, "top_p": r.top_p, "stop": list(r.stop_sequences),
                           "n": r.num_completions, "logprobs": 0,
                           "presence_penalty": r.presence_penalty, "frequency_penalty": r.frequency_penalty}
    if r.temperature == 0 and r.num_completions > 1:
        out["n"] = 1  # greedy samples are all the same: one, repeated (as HELM's clients do)
    return out


def request_result(r: Request, comps: list[Any], tok: Any, seconds: float, batch: int) -> RequestResult:
    """HELM's result for a request from its flexoff completions (one per sample); `seconds`: the
    time of the block of `batch` requests that ran it."""
    outs = []
    for c in comps:
        chosen = c.logprobs.chosen if c.logprobs is not None else [0.0] * len(c.token_ids)
        tokens = [Token(tok.decode([t]), float(lp)) for t, lp in zip(c.token_ids, chosen)]
        text = c.text
        if r.echo_prompt:  # the prompt's tokens come first, each scored given those before it
            ids = tok.encode(r.prompt)
            first = [0.0] + list(c.prompt_logprobs or [])
            tokens = [Token(tok.decode([t]), float(lp)) for t, lp in zip(ids, first)] + tokens
            text = r.prompt + text
        outs.append(GeneratedOutput(text=text, logprob=sum(t.logprob for t in tokens), tokens=tokens,
                                    finish_reason={"reason": c.finish_reason}))
    while len(outs) < r.num_completions:
        outs.append(outs[0])
    return RequestResult(success=True, embedding=[], completions=outs, cached=False, request_time=seconds / batch,
                         batch_size=batch, batch_request_time=seconds)


class FlexoffExecutor:
    """Stands in for HELM's `Executor`: runs a scenario state's requests through flexoff in one
    batched call, reusing results from the run's journal. `folder` is set per run."""

    def __init__(self, llm: Any, execution_spec: Any, context: Any,
                 on_progress: Callable[[int, int], None] | None = None):
        self.llm, self.execution_spec, self.context = llm, execution_spec, context
        self.on_progress = on_progress  # (done, total) as blocks finish
        self.folder: Path | None = None
        self.adapter: str | None = None  # the run's LoRA adapter (flexoff's adapter= key)
        self.reused = 0  # requests of the last run whose results came from its journal

    def journal(self) -> dict[str, RequestResult]:
        """Results of requests a previous run of this folder finished."""
        recs = appended_records(str(self.folder / JOURNAL), "flexoff eval journal record", "")
        return {rec["id"]: from_json(json.dumps(rec["result"]), RequestResult) for _, rec in recs}

    def execute(self, scenario_state: ScenarioState) -> ScenarioState:
        states: list[RequestState] = scenario_state.request_states
        keys = [request_key(s.request, self.adapter) for s in states]
        done = self.journal()
        todo: dict[str, Request] = {}
        for k, s in zip(keys, states):
            if k not in done:
                todo.setdefault(k, s.request)
        self.reused = len(states) - sum(1 for k in keys if k in todo)
        if self.on_progress:
            self.on_progress(self.reused, len(states))
        if todo:
            self._run(todo, done, keys)
        if self.on_progress:
            self.on_progress(len(states), len(states))
        return replace(scenario_state, request_states=[replace(s, result=done[k]) for k, s in zip(keys, states)])

    def _run(self, todo: dict[str, Request], done: dict[str, RequestResult], keys: list[str]) -> None:
        """Generate `todo` (by key), adding results to `done` and the journal block by block;
        progress counts the run's request states (`keys`), identical requests once each."""
        from flexoff.sampling import SamplingParams

        llm, tok = self.llm, self.llm.tokenizer
        echo = any(r.echo_prompt for r in todo.values())
        extra = {"adapter": self.adapter} if self.adapter else {}
        reqs = llm.make_requests([{**flexoff_request(k, r), **extra} for k, r in todo.items()], SamplingParams())
        appended_records(str(self.folder / EFFICIENCY), EFFICIENCY_RECORD, "")  # a crash's cut line goes first
        journal, blocks = ResultWriter(str(self.folder / JOURNAL)), ResultWriter(str(self.folder / EFFICIENCY))

        def on_block(comps: list[Any], st: Any) -> None:
            seconds = st.prefill_s + st.decode_s  # the block's own time, not loading the model
            by: dict[str, list[Any]] = {}
            for c in comps:
                by.setdefault(c.id, []).append(c)
            recs = []
            for k, cs in by.items():
                res = request_result(todo[k], sorted(cs, key=lambda c: c.index), tok, seconds, len(by))
                done[k] = res
                recs.append({"id": k, "result": asdict_without_nones(res)})
            journal.write(recs)
            blocks.write([{"requests": len(by), **{f: getattr(st, f) for f in BLOCK_FIELDS}}])
            if self.on_progress:
                self.on_progress(sum(k in done for k in keys), len(keys))

        try:
            llm.generate([], requests=reqs, on_block=on_block, prompt_logprobs=echo)
        finally:
            journal.close()
            blocks.close()


def efficiency(folder: Path) -> dict[str, float]:
    """FlexGen's padded vs actual throughput over every block the run's folder recorded."""
    blocks = [rec for _, rec in appended_records(str(folder / EFFICIENCY), EFFICIENCY_RECORD, "")]
    t = sum(b["prefill_s"] + b["decode_s"] for b in blocks)
    if not blocks or t <= 0:
        return {}
    actual = sum(b["prompt_tokens"] + b["generated_tokens"] for b in blocks)
    padded = sum(b["padded_prompt_tokens"] + b["padded_generated_tokens"] for b in blocks)
    return {"flexoff_inference_s": t, "padded_throughput": padded / t, "actual_throughput": actual / t,
            "padding_efficiency": actual / padded if padded else 1.0,
            "generation_throughput": sum(b["generated_tokens"] for b in blocks) / t}
