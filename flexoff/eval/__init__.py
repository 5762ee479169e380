"""The HELM-style offline evaluation harness (`flexoff eval`).

scenarios.py (instances; local-data scenarios) and synthetic.py (procedural reasoning) provide
instances, adapter.py builds prompts, metrics.py scores, runspec.py parses run entries,
runner.py executes and writes HELM's files, summarize.py tabulates a suite.
"""

from flexoff.eval import scenarios, synthetic  # noqa: F401  (synthetic registers its scenarios)
