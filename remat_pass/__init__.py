"""remat-pass: activation recomputation as a compiler pass over traced training graphs."""

import importlib.metadata

from .compile.backend import backend
from .errors import (
    GradientMismatch,
    InfeasibleBudget,
    InvalidOption,
    InvalidSchedule,
    LayerStackNotFound,
    RematError,
    UnsupportedGraph,
)
from .liveness.timeline import MemoryReport, analyze
from .measure.run import Measurement, measure_step, measured_step_timeline, run_joint, run_step
from .recompute.partition import Partition, SavedValue, Segment, partition
from .plan.planner import Plan, Planner
from .graph.regions import LayerStack, assign_layers, find_layer_stack
from .recompute.rewrite import RewrittenStep, rewrite
from .recompute.schedule import Schedule, megatron_schedules
from .evaluate.schedule_result import ScheduleResult
from .evaluate.session import Session, sweep
from .liveness.symbolic import SymbolicModel, trace_symbolic
from .graph.trace import JointGraph, trace_joint

__version__ = importlib.metadata.version("remat-pass")  # the installed distribution's (pyproject.toml)

__all__ = [
    "__version__",
    "GradientMismatch",
    "InfeasibleBudget",
    "InvalidOption",
    "InvalidSchedule",
    "JointGraph",
    "LayerStack",
    "LayerStackNotFound",
    "Measurement",
    "MemoryReport",
    "Partition",
    "Plan",
    "Planner",
    "RematError",
    "RewrittenStep",
    "SavedValue",
    "Schedule",
    "ScheduleResult",
    "Segment",
    "Session",
    "SymbolicModel",
    "UnsupportedGraph",
    "analyze",
    "assign_layers",
    "backend",
    "find_layer_stack",
    "measure_step",
    "measured_step_timeline",
    "megatron_schedules",
    "partition",
    "rewrite",
    "run_joint",
    "run_step",
    "sweep",
    "trace_joint",
    "trace_symbolic",
]
