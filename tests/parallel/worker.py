"""Run under torchrun by test_parallel.py: every (model, policy) case of a JSON file through the
pipeline the processes form; the first stage writes each case's completions (token ids and
log-probabilities) to the output JSON."""

from __future__ import annotations

import json
import sys

from flexoff import LLM, Policy, SamplingParams
from flexoff.parallel import init


def main(cases_path: str, out_path: str) -> None:
    cases = json.loads(open(cases_path).read())
    world = init(None)
    results, layers = [], []
    for case in cases:
        llm = LLM(case["model"], policy=Policy(**case["policy"]), device="cpu", world=world)
        try:
            out = llm.generate(case["prompts"], SamplingParams(**case["sampling"]))
        finally:
            llm.close()
        results.append([[c.token_ids, c.logprobs.chosen if c.logprobs else None] for c in out.completions])
        layers.append(len(llm.engine_spec.layers))
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"stages": world.stages, "stage_layers": layers, "results": results}, f)
    world.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
