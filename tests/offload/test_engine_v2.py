"""Engine v2: reverse sweeps in the plan, training sweeps through the offloaded layers against
float64 autograd through transformers, the stash on every tier, and the lean decode path."""

from __future__ import annotations

import pytest
import torch

from flexoff import LLM, Policy
from flexoff.offload.block import IGNORE, BatchInput
from flexoff.offload.engine import Engine
from flexoff.offload.schedule import Step, block_plan, training_sweeps
from flexoff.offload.weights import WeightStore
from reference import PROMPTS, hf_input_grads, train_batches


def test_a_reverse_sweep_visits_layers_downwards_and_stages_the_ones_below():
    L, K = 5, 2
    plans = list(block_plan(training_sweeps(1), L, K, ahead=2, at=1))
    fwd = [p.step for p in plans if not p.step.backward]
    bwd = [p.step for p in plans if p.step.backward]
    assert fwd == [Step(0, j, k) for j in range(L) for k in range(K)]
    assert bwd == [Step(0, j, k, True) for j in reversed(range(L)) for k in range(K)]
    staged = {(p.step.j, p.step.backward): p.stage for p in plans if p.stage}
    # forward: the next two layers up; at the top, the reverse sweep's first layers
    assert staged[(0, False)] == (1, 2) and staged[(L - 1, False)] == (L - 1, L - 2)
    for j in range(1, L):  # backward: the next two layers down
        assert staged[(j, True)] == tuple(range(j - 1, max(-1, j - 3), -1))
    assert all(p.stage == () for p in plans if p.step.k != 1)
    assert [p.next for p in plans] == [p.step for p in plans[1:]] + [None]


TRAIN_POLICIES = [
    Policy(gpu_batch_size=2, num_gpu_batches=3),
    Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=100, act_gpu_percent=0,
           act_cpu_percent=100, stash_gpu_percent=0, stash_cpu_percent=100),
    Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=20, w_cpu_percent=30, act_gpu_percent=50,
           act_cpu_percent=0, stash_gpu_percent=0, stash_cpu_percent=50, overlap=False),
    Policy(gpu_batch_size=6, num_gpu_batches=1, w_gpu_percent=0, w_cpu_percent=0, stash_gpu_percent=30,
           stash_cpu_percent=30),
]


@pytest.mark.parametrize("name", ["opt", "llama"])
def test_training_sweep_gradients_equal_float64_autograd_through_transformers(tiny, name):
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]]
    with LLM(str(tiny[name].path)) as llm:
        m = llm.model
        for policy in TRAIN_POLICIES:
            batches = train_batches(policy.gpu_batch_size, prompts)
            want_loss, want = hf_input_grads(tiny[name].hf, name, batches)
            e = Engine(m.family, m.spec, policy, device=torch.device("cpu"), dtype=torch.float64,
                       max_prompt=16, max_gen=1, training=True, offload_dir=None)
            try:
                e.load_weights((j, m.source.layer(j, lay, torch.float64, e.device))
                               for j, lay in enumerate(m.spec.layers))
                got = e.run_train(batches)
            finally:
                e.close()
            assert got.tokens == sum(int((b.labels != IGNORE).sum()) for b in batches)
            assert abs(got.loss - want_loss) < 1e-10 * max(1.0, abs(want_loss)), policy.describe()
            for g, w, b in zip(got.input_grads, want, batches):
                # padding positions carry no gradient in either; compare the real tokens
                err = (g - w)[b.valid].abs().max() / w[b.valid].abs().max()
                assert err < 1e-9, (policy.describe(), float(err))


def test_the_reverse_sweep_prefetches_weights_downwards(tiny, monkeypatch):
    staged: list[int] = []
    real = WeightStore.prefetch

    def spy(self, j):
        if j not in self._in_slot:  # a copy starts (not a layer already in a slot)
            staged.append(j)
        return real(self, j)

    monkeypatch.setattr(WeightStore, "prefetch", spy)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=100)
    with LLM(str(tiny["llama"].path)) as llm:
        m = llm.model
        e = Engine(m.family, m.spec, policy, device=torch.device("cpu"), dtype=torch.float32,
                   max_prompt=16, max_gen=1, training=True)
        try:
            e.load_weights((j, m.source.layer(j, lay, torch.float32, e.device)) for j, lay in enumerate(m.spec.layers))
            staged.clear()
            e.run_train(train_batches(2, PROMPTS[:4]))
        finally:
            e.close()
    L = len(m.spec.layers)
    # every layer's weights are copied into a slot once per sweep: up, then down (the top
    # layers are still in their slots when the reverse sweep starts)
    assert staged[:L] == list(range(L))
    assert staged[L:] == list(range(L - 3, -1, -1))


@pytest.mark.parametrize("name", ["opt", "llama"])
def test_the_lean_path_gives_the_scheduled_loops_tokens(tiny, tiny_refs, name):
    want = [r for r, _ in tiny_refs[name]]
    for shape in ((1, 1), (2, 3)):
        policy = Policy(gpu_batch_size=shape[0], num_gpu_batches=shape[1])
        with LLM(str(tiny[name].path), policy=policy) as llm:
            got = [c.token_ids for c in llm.generate([{"prompt_ids": q} for q in PROMPTS],
                                                       max_new_tokens=8).completions]
            assert llm.engine.lean is not None  # everything on the compute device: the lean path ran
            llm.engine.lean = None  # the scheduled loop, step by step
            loop = [c.token_ids for c in llm.generate([{"prompt_ids": q} for q in PROMPTS],
                                                        max_new_tokens=8).completions]
        assert got == loop == want


def test_the_lean_path_is_only_taken_where_nothing_moves(tiny):
    with LLM(str(tiny["opt"].path), policy=Policy(gpu_batch_size=2, w_gpu_percent=50, w_cpu_percent=50)) as llm:
        llm.generate([{"prompt_ids": [1, 2, 3]}], max_new_tokens=2)
        assert llm.engine.lean is None
    with LLM(str(tiny["opt"].path), policy=Policy(gpu_batch_size=2, cache_gpu_percent=50,
                                                  cache_cpu_percent=50)) as llm:
        llm.generate([{"prompt_ids": [1, 2, 3]}], max_new_tokens=2)
        assert llm.engine.lean is None
