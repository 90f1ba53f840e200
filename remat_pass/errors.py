"""Exception types raised by remat-pass.

Every error says what was wrong, why, and what is allowed; callers catch by type,
never by message text. ``RematError``, ``InvalidSchedule`` and ``InfeasibleBudget`` are
defined in ``solvers.errors`` (the solvers raise them and import no torch) and
re-exported here.
"""

from __future__ import annotations

from solvers.errors import InfeasibleBudget, InvalidSchedule, RematError

__all__ = [
    "GradientMismatch",
    "InfeasibleBudget",
    "InvalidOption",
    "InvalidSchedule",
    "LayerStackNotFound",
    "RematError",
    "StepNotComposable",
    "UnsupportedGraph",
]


class LayerStackNotFound(RematError):
    """No repeated layer stack was found, or the named one does not exist."""


class UnsupportedGraph(RematError):
    """The traced graph holds something the rewrite cannot handle without changing
    gradients (an input mutation, a random op whose RNG state cannot be replayed)."""


class GradientMismatch(RematError):
    """The rewritten step's gradients differ from the un-rewritten joint graph's."""


class InvalidOption(RematError, ValueError):
    """An option (of the torch.compile backend, a command, a file read back) is not one
    that is accepted; the message names the allowed values."""


class StepNotComposable(UnsupportedGraph):
    """The graphs of a compiled training step did not run as one step of forwards then
    backwards in autograd's order (a backward run twice, out of order, or after another
    forward), so their timelines cannot be composed into the step's."""
