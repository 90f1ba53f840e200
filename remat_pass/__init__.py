"""remat-pass: activation recomputation as a compiler pass over traced training graphs."""

from .backend import backend
from .errors import (
    GradientMismatch,
    InfeasibleBudget,
    InvalidSchedule,
    LayerStackNotFound,
    RematError,
    UnsupportedGraph,
)
from .liveness import MemoryReport, analyze
from .measure import Measurement, measure_step, run_joint, run_step
from .regions import LayerStack, assign_layers, find_layer_stack
from .rewrite import RewrittenStep, rewrite
from .schedule import Schedule
from .trace import JointGraph, trace_joint

__all__ = [
    "GradientMismatch",
    "InfeasibleBudget",
    "InvalidSchedule",
    "JointGraph",
    "LayerStack",
    "LayerStackNotFound",
    "Measurement",
    "MemoryReport",
    "RematError",
    "RewrittenStep",
    "Schedule",
    "UnsupportedGraph",
    "analyze",
    "assign_layers",
    "backend",
    "find_layer_stack",
    "measure_step",
    "rewrite",
    "run_joint",
    "run_step",
    "trace_joint",
]
