"""The offload engine: memory tiers, placement, the copy engine and the block schedule.

offload/ executes a Policy it is handed; it never searches for one.
"""

from flexoff.offload.engine import BatchInput, BlockResult, Engine
from flexoff.offload.tiers import Budgets

__all__ = ["Engine", "BatchInput", "BlockResult", "Budgets"]
