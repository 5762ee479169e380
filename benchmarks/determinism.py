"""Run-to-run determinism of offloaded, compressed generation on the GPU: the GPU test's setting
(OPT-30B-sized layers cut to 4, 64 prompts of 560-608 tokens, 4 new tokens, a 16x4 policy with
4-bit weights and cache streamed from CPU memory) run several times, overlap on and off in turn.
Prints one JSON line per run: whether every token equals the first run's, the largest difference
of the chosen tokens' log-probabilities, and for each sequence that differs, the first differing
step with both runs' margin between their top two log-probabilities there (a margin of 0: a tie).
Usage: python3 benchmarks/determinism.py [on,off,on,...]  (needs CUDA)"""
import json
import pathlib
import sys
import tempfile

import torch
from flexoff import LLM, Policy
from flexoff.dummy import dummy_config

if not torch.cuda.is_available():
    sys.exit("benchmarks/determinism.py: needs a CUDA device")
tmp = pathlib.Path(tempfile.mkdtemp())
cfg = dict(dummy_config("opt-30b"), num_hidden_layers=4)
(tmp / "config.json").write_text(json.dumps(cfg))
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_ids": torch.randint(3, cfg["vocab_size"], (560 + 8 * (i % 7),), generator=g).tolist(),
            "logprobs": 2, "max_new_tokens": 4} for i in range(64)]
streamed = Policy(gpu_batch_size=16, num_gpu_batches=4, w_gpu_percent=0, w_cpu_percent=100,
                  cache_gpu_percent=12.5, cache_cpu_percent=87.5, act_gpu_percent=0, act_cpu_percent=100,
                  compress_weight=True, compress_cache=True)
order = sys.argv[1].split(",") if len(sys.argv) > 1 else ["on", "off", "on", "off", "on", "off"]
runs = []
with LLM(f"dummy:{tmp / 'config.json'}", device="cuda", dtype="float16") as llm:
    llm.model.tokenizer.eos_ids = ()
    for o in order:
        llm.policy_arg = streamed if o == "on" else streamed.replace(overlap=False)
        got = llm.generate(prompts).completions
        runs.append([(c.token_ids, c.logprobs.chosen, c.logprobs.top) for c in got])
        llm.drop_engine()
ref = runs[0]
for k, (o, r) in enumerate(zip(order, runs)):
    diffs = []
    maxlp = 0.0
    for i, ((ta, la, pa), (tb, lb, pb)) in enumerate(zip(ref, r)):
        n = next((s for s in range(len(ta)) if ta[s] != tb[s]), None)
        upto = len(ta) if n is None else n + 1
        maxlp = max(maxlp, max(abs(x - y) for x, y in zip(la[:upto], lb[:upto])))
        if n is not None:
            def margin(top, s):
                v = sorted((val for _, val in top[s]), reverse=True)
                return round(v[0] - v[1], 5) if len(v) > 1 else None
            diffs.append(dict(seq=i, step=n, ref=(ta[n], margin(pa, n)), run=(tb[n], margin(pb, n))))
    print(json.dumps(dict(run=k, overlap=o, same=not diffs, max_chosen_lp_diff=round(maxlp, 5), diffs=diffs)), flush=True)
