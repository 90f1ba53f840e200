"""The exception types shared by the solvers and remat_pass (which re-exports them).

They live here so that ``solvers`` imports neither torch nor ``remat_pass``; every
error says what was wrong, why, and what is allowed. Callers catch by type.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error raised by remat-pass and its solvers."""


class InvalidSchedule(RematError, ValueError):
    """A schedule argument (K, N, groups) is outside what the layer stack allows."""


class InfeasibleBudget(RematError):
    """No schedule fits the requested budget.

    Attributes:
        least_feasible_peak_bytes: the smallest peak (bytes) any schedule reaches.
        budget_bytes: the budget that was asked for (bytes).
    """

    def __init__(self, message: str, *, least_feasible_peak_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.least_feasible_peak_bytes = least_feasible_peak_bytes
        self.budget_bytes = budget_bytes


def infeasible(budget_bytes: int, least_feasible_peak_bytes: int, least_schedule: str = "") -> InfeasibleBudget:
    """The InfeasibleBudget for ``budget_bytes`` below ``least_feasible_peak_bytes``,
    with the message every caller prints (bytes and MiB, the schedule reaching it)."""
    where = f", {least_schedule}" if least_schedule else ""
    return InfeasibleBudget(
        f"no schedule fits a peak budget of {budget_bytes} bytes ({budget_bytes / 2**20:.2f} MiB): "
        f"the least feasible peak is {least_feasible_peak_bytes} bytes "
        f"({least_feasible_peak_bytes / 2**20:.2f} MiB{where}); raise the budget to at least that",
        least_feasible_peak_bytes=least_feasible_peak_bytes,
        budget_bytes=budget_bytes,
    )
