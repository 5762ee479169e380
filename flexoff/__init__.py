"""flexoff: high-throughput offline inference for models larger than GPU memory.

    from flexoff import LLM
    llm = LLM("smollm2")
    out = llm.generate(["The capital of France is"], max_new_tokens=8)
    print(out.completions[0].text, out.stats.generation_throughput)
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub at run time
# Loading and prefill make temporaries of many sizes; growable segments keep the CUDA allocator
# from fragmenting under a --gpu-mem cap (read by torch when CUDA starts, so set it first).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from flexoff.api import LLM, GenerationOutput  # noqa: E402
from flexoff.errors import FlexoffError  # noqa: E402
from flexoff.generation import Completion, RunStats  # noqa: E402
from flexoff.policy.policy import Policy  # noqa: E402
from flexoff.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "GenerationOutput", "Completion", "RunStats", "Policy", "SamplingParams", "FlexoffError"]
