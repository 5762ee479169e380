"""User-facing errors.

Knows: the exception types a user can cause (bad input, bad flags, missing files,
infeasible memory budgets). Every one is a `FlexoffError`, whose message says what
was wrong and what would work; the CLI prints it as one line and exits 2.
Does not know: how errors are printed (that is the CLI's job).
"""


class FlexoffError(Exception):
    """A user error: the message names the problem and a way out."""


class ModelError(FlexoffError):
    """Unknown model name, unsupported architecture or malformed config."""


class CheckpointError(FlexoffError):
    """Missing, unreadable or corrupt weights or tokenizer files."""


class InputError(FlexoffError):
    """Malformed prompts file, empty prompt, prompt longer than the context."""


class PolicyError(FlexoffError):
    """An invalid offloading policy (percentages, batch shape)."""


class MemoryBudgetError(FlexoffError):
    """A policy that does not fit the memory budgets it is given."""


class GpuOutOfMemoryError(MemoryBudgetError):
    """The GPU ran out of memory under a policy the engine's plan accepted."""
