"""Policies: the Policy type, the hardware profile, the cost model and the LP search.

policy/ never imports offload/: it plans, the engine executes.
"""

from flexoff.policy.policy import PERCENT_FIELDS, Policy

__all__ = ["Policy", "PERCENT_FIELDS"]
