"""Schedule solvers: plain costs in, recompute groups out. Imports neither torch nor
``remat_pass``.

- ``solvers.chain``: the chain model of a layer stack under Megatron-style full
  recompute.
- ``solvers.chain_search``: an exact dynamic program over it (Pareto front of peak bytes
  versus recompute FLOPs): the least recompute under a peak budget, the least peak under
  a recompute budget.
- ``solvers.resolve``: the same answers checked against an exact predictor
  (``predict(groups) -> bytes``), re-solving tighter when the model overshoots.
- ``solvers.poly``: integer polynomials in shape symbols (symbolic sizes).
- ``solvers.closed_forms``: Megatron uniform / block peaks in closed form (sympy).
- ``solvers.oplevel``: one layer's exact Pareto front of saved bytes against recompute
  cost (integer programs, HiGHS through ``scipy.optimize.milp``).
- ``solvers.theoretical_memory``: Megatron-LM's theoretical activation bytes
  (Korthikanti et al. 2022), for comparison with liveness.
- ``solvers.errors``: the error types (re-exported by ``remat_pass.errors``).
"""

from .chain import ChainCosts, Solution, StackGap, StoredOption, model_peak
from .chain_search import least_feasible_peak, least_peak, least_recompute, pareto_front
from .errors import InfeasibleBudget, InvalidSchedule, RematError
from .resolve import CheckedPlan, least_feasible_checked, least_recompute_checked, least_recompute_offset

__all__ = [
    "ChainCosts",
    "CheckedPlan",
    "InfeasibleBudget",
    "InvalidSchedule",
    "RematError",
    "Solution",
    "StackGap",
    "StoredOption",
    "least_feasible_checked",
    "least_feasible_peak",
    "least_peak",
    "least_recompute",
    "least_recompute_checked",
    "least_recompute_offset",
    "model_peak",
    "pareto_front",
]
