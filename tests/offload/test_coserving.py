"""Co-served blocks: training windows in the same block as inference batches (their forward in
the prefill's sweep, their reverse sweep after it, then decode). The inference rows get
transformers' greedy tokens and the windows get float64 autograd's loss and gradients, for
resident, streamed and CPU-attention policies."""

from __future__ import annotations

import pytest
import torch

from flexoff import LLM, Policy
from flexoff.generation import pad_left
from flexoff.offload.block import IGNORE
from flexoff.offload.engine import Engine
from reference import PROMPTS, hf_input_grads, train_batches

COSERVE_POLICIES = [
    Policy(gpu_batch_size=2, num_gpu_batches=4),
    Policy(gpu_batch_size=2, num_gpu_batches=4, w_gpu_percent=0, w_cpu_percent=100, cache_gpu_percent=50,
           cache_cpu_percent=50, act_gpu_percent=0, act_cpu_percent=100, stash_gpu_percent=0, stash_cpu_percent=100),
    Policy(gpu_batch_size=2, num_gpu_batches=3, w_gpu_percent=20, w_cpu_percent=30, stash_gpu_percent=0,
           stash_cpu_percent=50, overlap=False),
    Policy(gpu_batch_size=2, num_gpu_batches=4, w_gpu_percent=0, w_cpu_percent=100, cache_gpu_percent=0,
           cache_cpu_percent=100, cpu_cache_compute=True, stash_gpu_percent=50, stash_cpu_percent=0),
]
TRAIN_ROWS = [PROMPTS[4], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [6, 6, 6]]
GEN = 6


@pytest.mark.parametrize("name", ["opt", "llama"])
def test_a_coserved_block_gives_inference_its_tokens_and_training_its_gradients(tiny, tiny_refs, name):
    S = max(len(p) for p in PROMPTS)  # one padded length for every batch of the block
    with LLM(str(tiny[name].path)) as llm:
        m = llm.model
        for policy in COSERVE_POLICIES:
            gbs = policy.gpu_batch_size
            infer = [pad_left(PROMPTS[r:r + gbs], S) for r in range(0, 4, gbs)]
            room = policy.num_gpu_batches - len(infer)  # the block's batches left for training windows
            train = train_batches(gbs, TRAIN_ROWS[:gbs * room] + [[8] * S])[:room]  # padded to S too
            want_loss, want_grads = hf_input_grads(tiny[name].hf, name, train)
            e = Engine(m.family, m.spec, policy, device=torch.device("cpu"), dtype=torch.float64,
                       max_prompt=S, max_gen=GEN, training=True, windows=room)
            assert len(e.kv.homes[0]) == len(infer)  # a window keeps no KV cache
            steps: list[list[torch.Tensor]] = []

            def on_tokens(i: int, toks: list[torch.Tensor]) -> bool:
                steps.append([t.clone() for t in toks])
                return False

            try:
                e.load_weights((j, m.source.layer(j, lay, torch.float64, e.device)) for j, lay in enumerate(m.spec.layers))
                res = e.run_block(infer + train, GEN, lambda logits, k, i: logits.argmax(-1), on_tokens)
            finally:
                e.close()
            got = [[int(steps[i][r // gbs][r % gbs]) for i in range(GEN)] for r in range(4)]
            assert got == [tiny_refs[name][r][0][:GEN] for r in range(4)], policy.describe()
            assert res.steps == GEN and len(steps[0]) == len(infer)  # the windows deliver no tokens
            t = res.train
            assert t is not None and t.tokens == sum(int((b.labels != IGNORE).sum()) for b in train)
            assert abs(t.loss - want_loss) < 1e-10 * max(1.0, abs(want_loss)), policy.describe()
            for g, w, b in zip(t.input_grads, want_grads, train):
                err = (g - w)[b.valid].abs().max() / w[b.valid].abs().max()
                assert err < 1e-9, (policy.describe(), float(err))


def test_training_windows_must_follow_the_inference_batches(tiny):
    with LLM(str(tiny["llama"].path)) as llm:
        m = llm.model
        e = Engine(m.family, m.spec, Policy(gpu_batch_size=2, num_gpu_batches=2), device=torch.device("cpu"),
                   dtype=torch.float32, max_prompt=15, max_gen=2, training=True)
        try:
            e.load_weights((j, m.source.layer(j, lay, torch.float32, e.device)) for j, lay in enumerate(m.spec.layers))
            with pytest.raises(AssertionError, match="after inference"):
                e.run_block(train_batches(2, [TRAIN_ROWS[0], [8] * 15]) + [pad_left(PROMPTS[:2], 15)], 2,
                            lambda logits, k, i: logits.argmax(-1), lambda i, t: False)
        finally:
            e.close()
