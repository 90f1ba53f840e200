"""Schedule solvers: plain per-layer costs in, recompute groups out (never imports torch.fx).

``solvers.chain`` holds the chain model of a layer stack under Megatron-style full
recompute and an exact dynamic program over it (Pareto front of peak bytes versus
recompute FLOPs): the least recompute under a peak budget, and the least peak under a
recompute budget.
"""

from .chain import (
    ChainCosts,
    Solution,
    least_feasible_peak,
    least_peak,
    least_recompute,
    model_peak,
    pareto_front,
)

__all__ = ["ChainCosts", "Solution", "least_feasible_peak", "least_peak", "least_recompute", "model_peak", "pareto_front"]
