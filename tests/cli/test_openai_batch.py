"""OpenAI batch files end to end on SmolLM2: chat and completion lines answered, a bad line
answered with its error without stopping the job, output bodies read by the `openai` package's
own types, logprobs as OpenAI shapes them, resumption by custom_id."""

from __future__ import annotations

import json

import pytest

from flexoff.cli import main

openai_types = pytest.importorskip("openai.types")  # in the test extra


def line(cid: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_openai_batch_file_on_smollm2(tmp_path, capsys):
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    inp, out = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    inp.write_text("\n".join([
        line("chat-1", "/v1/chat/completions", {"model": "smollm2", "max_tokens": 8, "temperature": 0,
                                                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                                                "logprobs": True, "top_logprobs": 2}),
        line("text-1", "/v1/completions", {"model": "smollm2", "prompt": "The capital of France is",
                                           "max_tokens": 4, "temperature": 0, "logprobs": 1}),
        line("bad-1", "/v1/chat/completions", {"model": "smollm2", "messages": [], "max_tokens": 4}),
        line("bad-2", "/v1/embeddings", {"model": "smollm2", "input": "x"}),
        line("chat-2", "/v1/chat/completions", {"max_completion_tokens": 4, "n": 2, "seed": 7,
                                                "messages": [{"role": "user", "content": "Say hi."}]}),
    ]) + "\n")
    assert main(["run", "--input", str(inp), "--output", str(out), "-q"]) == 0, capsys.readouterr().err
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == ["bad-1", "bad-2", "chat-1", "chat-2", "text-1"]
    for cid in ("bad-1", "bad-2"):
        r = recs[cid]
        assert r["response"] is None and r["id"].startswith("batch_req_")
        err = BatchError.model_validate(r["error"])
        assert err.code == "invalid_request" and err.message
    chat = ChatCompletion.model_validate(recs["chat-1"]["response"]["body"])
    assert recs["chat-1"]["response"]["status_code"] == 200 and recs["chat-1"]["error"] is None
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    text = Completion.model_validate(recs["text-1"]["response"]["body"])
    assert text.object == "text_completion" and text.choices[0].logprobs.tokens
    assert "".join(text.choices[0].logprobs.tokens) == text.choices[0].text
    two = ChatCompletion.model_validate(recs["chat-2"]["response"]["body"])
    assert [c.index for c in two.choices] == [0, 1]  # OpenAI's default temperature 1: two draws

    before = out.read_text()  # a rerun answers nothing twice
    assert main(["run", "--input", str(inp), "--output", str(out), "-q"]) == 0
    assert out.read_text() == before


def test_batch_file_errors_that_stop_the_job(tmp_path, capsys):
    inp, out = tmp_path / "batch.jsonl", tmp_path / "o.jsonl"
    body = {"messages": [{"role": "user", "content": "x"}]}
    for text, says in ((line("a", "/v1/chat/completions", body) + "\n" + line("a", "/v1/chat/completions", body),
                        "duplicate custom_id"),
                       (line("a", "/v1/chat/completions", body) + "\n{\"body\": {}}", "custom_id")):
        inp.write_text(text + "\n")
        code = main(["run", "--model", "dummy:opt-tiny", "--input", str(inp), "--output", str(out), "-q"])
        err = capsys.readouterr().err
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1
        assert not out.exists()
