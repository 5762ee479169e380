"""`flexoff eval`: HELM's own runs (crfm-helm, the `eval` extra) with flexoff as the model.

helm_env.py imports HELM and registers the model with it, executor.py is the batched offline
executor and tokenizer HELM calls, runner.py reads run entries and drives HELM's Runner.
Importing this package does not import HELM.
"""
