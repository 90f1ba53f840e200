"""Exception types raised by remat-pass.

Every error says what was wrong, why, and what is allowed; callers catch by type,
never by message text.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error raised by remat-pass."""


class LayerStackNotFound(RematError):
    """No repeated layer stack was found, or the named one does not exist."""


class InvalidSchedule(RematError, ValueError):
    """A schedule argument (K, N, groups) is outside what the layer stack allows."""


class UnsupportedGraph(RematError):
    """The traced graph holds something the rewrite cannot handle without changing
    gradients (an input mutation, a random op whose RNG state cannot be replayed)."""


class InfeasibleBudget(RematError):
    """No schedule fits the requested budget.

    Attributes:
        least_feasible_peak_bytes: the smallest peak (bytes) any schedule reaches.
        budget_bytes: the budget that was asked for.
    """

    def __init__(self, message: str, *, least_feasible_peak_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.least_feasible_peak_bytes = least_feasible_peak_bytes
        self.budget_bytes = budget_bytes


class GradientMismatch(RematError):
    """The rewritten step's gradients differ from the un-rewritten joint graph's."""
