"""remat-pass: activation recomputation as a compiler pass over traced training graphs."""

from .backend import backend
from .errors import (
    GradientMismatch,
    InfeasibleBudget,
    InvalidOption,
    InvalidSchedule,
    LayerStackNotFound,
    RematError,
    UnsupportedGraph,
)
from .liveness import MemoryReport, analyze
from .measure import Measurement, measure_step, measured_step_timeline, run_joint, run_step
from .partition import Partition, SavedValue, Segment, partition
from .planner import Plan, Planner
from .regions import LayerStack, assign_layers, find_layer_stack
from .rewrite import RewrittenStep, rewrite
from .schedule import Schedule, megatron_schedules
from .schedule_result import ScheduleResult
from .sweep import Session, sweep
from .symbolic import SymbolicModel, trace_symbolic
from .trace import JointGraph, trace_joint

__all__ = [
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
