"""`--policy auto`'s trials (flexoff.trials): measured on the CPU with a tiny model, whose steps
cost the host's time per step, so that eight GPU batches of one row run slower than one of eight."""

from __future__ import annotations

import pytest

from flexoff.policy.cost_model import Prediction
from flexoff.policy.policy import Policy
from flexoff.policy.search import Candidate

ONE_OF_EIGHT = Policy(gpu_batch_size=8, num_gpu_batches=1)
EIGHT_OF_ONE = Policy(gpu_batch_size=1, num_gpu_batches=8)


def cand(policy: Policy, tok_s: float, latency: float = 10.0) -> Candidate:
    return Candidate(policy, Prediction(latency / 10, latency * 0.9, tok_s, "test", {}, {}))


def test_trials_keep_the_fastest_measured_not_the_first_searched(tiny, monkeypatch):
    from flexoff import LLM, trials

    timed: list[Policy] = []
    real = trials.measure

    def spy(llm, policy, prompt_len, gen_len):
        timed.append(policy)
        return real(llm, policy, prompt_len, gen_len)

    monkeypatch.setattr(trials, "measure", spy)
    with LLM(str(tiny["llama"].path), device="cpu", dtype="float32") as llm:
        # the search ranked eight one-row batches first; per step they cost eight times the host's time
        chosen, done = trials.choose(llm, [cand(EIGHT_OF_ONE, 100.0), cand(ONE_OF_EIGHT, 90.0)], 12, 16)
    assert chosen == ONE_OF_EIGHT
    assert timed == [EIGHT_OF_ONE, EIGHT_OF_ONE, ONE_OF_EIGHT]  # the first twice: the first time warms
    by = {t.policy: t for t in done}
    assert by[ONE_OF_EIGHT].tok_s > by[EIGHT_OF_ONE].tok_s > 0
    assert by[EIGHT_OF_ONE].predicted_tok_s == 100.0 and all(t.seconds > 0 for t in done)


def test_a_trial_estimates_the_whole_block_from_its_steps():
    from flexoff.trials import block_seconds

    # a prefill of 2 s, then 8 steps in 4 s: 31 steps of a 32-token generation take 15.5 s
    assert block_seconds(2.0, 4.0, 8, 32) == pytest.approx(17.5)


def test_trials_run_only_where_they_cost_a_small_share_of_the_job():
    from flexoff.trials import SETUP_S, TRIAL_SHARE, distinct, worth_trying

    a, b = cand(Policy(gpu_batch_size=8, num_gpu_batches=2), 50.0), cand(ONE_OF_EIGHT, 45.0)
    assert distinct([a, b, cand(a.policy, 40.0)]) == [a, b]
    assert not worth_trying([a], 32, None)  # nothing to choose between
    assert worth_trying([a, b], 32, None)  # a job of unknown length: a benchmark's block standing for a long one
    # at 10 s a block of 16, three trials (the first plan twice) of 9 tokens in 32 cost about
    # 3 x (1 + 9 x 8/31) = 10.0 s, and two engines' set-ups
    blocks_needed = (10.0 + 2 * SETUP_S) / (TRIAL_SHARE * 10.0)
    assert not worth_trying([a, b], 32, int(16 * (blocks_needed - 2)))
    assert worth_trying([a, b], 32, int(16 * (blocks_needed + 2)))


def test_auto_runs_the_job_after_timing_its_candidates(tiny, tiny_refs, tmp_path, monkeypatch):
    """With trials allowed off the GPU, `--policy auto` searches at the priced CPU-attention rate and
    LANE_SPREAD either side, times the distinct bests, and runs the job under the fastest with the
    reference tokens. (A tiny model's plans do not move with the rate: the search at the higher
    rate is made to rank its runner-up first, as a plan that differs.)"""
    import flexoff.autopolicy as autopolicy
    from flexoff import LLM, trials
    from flexoff.policy.hardware import save
    from reference import PROMPTS
    from test_search import h200, load_model

    hw = h200()
    profile = tmp_path / "hw.json"
    save(hw.__class__(**{**hw.__dict__, "device": "cpu", "name": "test"}), profile)
    monkeypatch.setattr(trials, "applies", lambda llm, stages, hw: True)
    monkeypatch.setattr(trials, "TRIAL_SHARE", 1e9)  # a job of a few prompts: trials would not pay
    monkeypatch.setenv("FLEXOFF_CALIBRATE", "0")
    rates: list[float] = []
    real_search = autopolicy.search

    def search(spec, hw_, work, budget, **kw):
        rates.append(hw_.cpu_attn_bdw)
        cands = real_search(spec, hw_, work, budget, **kw)
        return cands[1:] if hw_.cpu_attn_bdw > hw.cpu_attn_bdw else cands  # the runner-up first

    monkeypatch.setattr(autopolicy, "search", search)
    s = load_model(str(tiny["llama"].path)).spec
    gpu_mem = s.weight_bytes(4) // 2 + s.working_bytes(len(PROMPTS), 15, 4, "cpu")  # half the weights fit
    with LLM(str(tiny["llama"].path), policy="auto", hardware=str(profile), gpu_mem=gpu_mem,
             cpu_mem=1 << 30) as llm:
        out = llm.generate([{"prompt_ids": p} for p in PROMPTS], max_new_tokens=8)
        done = llm.last_trials
    r = hw.cpu_attn_bdw
    assert sorted({*rates}) == pytest.approx([r * (1 - trials.LANE_SPREAD), r, r * (1 + trials.LANE_SPREAD)])
    assert len(done) == 2 and all(t.tok_s for t in done)  # the low rate's plan is the priced one's
    assert out.policy == max(done, key=lambda t: t.tok_s).policy
    assert [c.token_ids for c in out.completions] == [r for r, _ in tiny_refs["llama"]]


def test_a_trial_that_runs_out_of_gpu_memory_is_left_out_not_searched_again(tiny, monkeypatch):
    import torch

    import flexoff.api as api
    from flexoff import LLM, trials

    real = api.run_block

    def short_of_memory(engine, *args, **kw):  # the first candidate's blocks run out (simulated)
        if engine.policy == EIGHT_OF_ONE:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(engine, *args, **kw)

    monkeypatch.setattr(api, "run_block", short_of_memory)
    with LLM(str(tiny["llama"].path), policy="auto", device="cpu", dtype="float32", progress=True) as llm:
        chosen, done = trials.choose(llm, [cand(EIGHT_OF_ONE, 100.0), cand(ONE_OF_EIGHT, 90.0)], 12, 16)
        assert llm.policy_arg == "auto" and llm.progress is True  # both given back
    assert chosen == ONE_OF_EIGHT
    assert {t.policy: t.tok_s is None for t in done} == {EIGHT_OF_ONE: True, ONE_OF_EIGHT: False}
