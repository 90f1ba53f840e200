"""The options of the torch.compile backend, validated when the backend is made.

One value (``BackendOptions``, frozen and hashable) holds what ``remat_pass.backend(...)``
or ``torch.compile(backend="remat", options={...})`` was given. K and N are validated
with the same rules as the Python API (``schedule.py``), except the upper bound L, which
is known only when a graph is compiled.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Any

from ..recompute import schedule as schedules
from ..errors import InvalidOption, InvalidSchedule
from ..formatting import parse_bytes
from ..recompute.policies import KINDS, POLICIES

SCHEDULES = ("none", "uniform", "block", "optimized")
GRANULARITIES = ("layer", "op")
COMPILERS = ("eager", "inductor")
ON_ERROR = ("raise", "fallback")
OPTION_KEYS = ("schedule", "recompute_num_layers", "budget_bytes", "compiler", "layers", "report_dir", "calibrate",
               "granularity", "recompute_modules", "policy", "policy_names", "module_names", "flops_per_byte", "on_error")
COMPILE_MODES = (None, "default")
DEPRECATED_KEYS = {"num_layers": "recompute_num_layers"}
REPORT_DIR_ENV = "REMAT_PASS_REPORT_DIR"


class InvalidBackendOption(InvalidOption):
    """A backend option other than the schedule (compiler, layers, report_dir, an
    unknown key) is not one the backend accepts."""


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Options of the remat backend (the keys of ``torch.compile(options=...)``).

    Attributes:
        schedule: ``"none"``, ``"uniform"`` or ``"block"`` (Megatron-LM's
            ``--recompute-method``), or ``"optimized"``: per compiled graph, the
            least-recompute groups whose predicted peak fits ``budget_bytes``
            (``planner.Planner``: the chain-model solver, checked by liveness).
        recompute_num_layers: K for uniform (1..L), N for block (0..L), Megatron-LM's
            ``--recompute-num-layers``; required for uniform and block (no default:
            Megatron-LM's is 1, the old default here was 4, so it is asked for rather
            than guessed); ignored for none. L, the number of layers of the stack, is
            checked when a graph is compiled.
        budget_bytes: for ``optimized``: the peak activation bytes allowed for the
            training step (static memory excluded, as ``MemoryReport.peak_bytes``); an
            int, or a string with a unit (``"80MiB"``, ``"1.5GB"``), stored as an int.
        compiler: ``"eager"`` (run the fx graphs) or ``"inductor"``.
        layers: module path of the layer stack relative to the compiled module
            (``"transformer.h"``); None to find it.
        report_dir: folder to write every graph's report to (JSON, Markdown and a
            ``remat-pass inspect`` dump); None reads ``$REMAT_PASS_REPORT_DIR``
            (unset: nothing is written).
        calibrate: calibrate op scratch on this CPU for the predicted peaks (the
            ``optimized`` budget holds with it; ``calibration.Calibrator``, cached under
            ``~/.cache/remat-pass``); False: the formula table only.
        granularity: ``"layer"`` (whole layers) or ``"op"``: with ``optimized``, the
            op-level optimum under ``budget_bytes`` (``op_planner.OpPlanner`` per graph,
            then against the composed step, ``step_planning``); else
            ``recompute_modules`` or ``policy`` in the layers the schedule stores.
        recompute_modules: Megatron-Core module kinds to recompute (``policies.KINDS``;
            ``("core_attn",)`` is Megatron-LM's selective recompute).
        policy: a JAX save policy (``policies.POLICIES``); ``policy_names`` its names.
        module_names: ``{kind: module paths inside a layer}`` for kinds not recognised.
        flops_per_byte: the op-level cost model's machine balance (``CostModel``).
        on_error: ``"raise"`` or ``"fallback"`` (run what the pass cannot handle
            un-rewritten, with a warning).

    Raises:
        InvalidSchedule: unknown schedule, K / N not an integer in range, a budget
            without ``optimized``, ``optimized`` without a positive budget, a budget
            string without a unit, an
            unknown granularity, module kind or policy, op-level options with
            ``granularity="layer"``, or not exactly one op-level choice with ``"op"``.
        InvalidBackendOption: unknown compiler or ``on_error``, or ``layers`` /
            ``report_dir`` of the wrong type.
    """

    schedule: str = "uniform"
    recompute_num_layers: int | None = None
    budget_bytes: int | str | None = None
    compiler: str = "eager"
    layers: str | None = None
    report_dir: str | None = None
    calibrate: bool = True
    granularity: str = "layer"
    recompute_modules: tuple[str, ...] = ()
    policy: str | None = None
    policy_names: tuple[str, ...] = ()
    module_names: tuple[tuple[str, tuple[str, ...]], ...] = ()
    flops_per_byte: int = 8
    on_error: str = "raise"

    def __post_init__(self) -> None:
        # lists and dicts from torch.compile(options=...) become tuples (hashable)
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules or ()))
        object.__setattr__(self, "policy_names", tuple(self.policy_names or ()))
        names = self.module_names.items() if isinstance(self.module_names, dict) else (self.module_names or ())
        object.__setattr__(self, "module_names", tuple((k, tuple(v)) for k, v in names))
        self._check_types()
        self._check_schedule()
        self._check_granularity()

    def _check_granularity(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise InvalidSchedule(f"granularity={self.granularity!r} is not one of {', '.join(GRANULARITIES)}")
        op_options = [k for k in ("recompute_modules", "policy", "policy_names", "module_names") if getattr(self, k)]
        if self.granularity == "layer":
            if op_options:
                verb = "needs" if len(op_options) == 1 else "need"
                raise InvalidSchedule(f"{', '.join(op_options)} {verb} granularity='op' (granularity={self.granularity!r})")
            return
        bad = [k for k in self.recompute_modules + tuple(k for k, _ in self.module_names) if k not in KINDS]
        if bad:
            raise InvalidSchedule(f"module kind(s) {bad} are not recompute modules; the kinds are {', '.join(KINDS)}")
        if self.policy is not None and self.policy not in POLICIES:
            raise InvalidSchedule(f"policy={self.policy!r} does not exist; the policies are {', '.join(POLICIES)}")
        choices = [bool(self.recompute_modules), self.policy is not None, self.schedule == "optimized"]
        if sum(choices) != 1:
            raise InvalidSchedule(
                "granularity='op' needs exactly one of: recompute_modules=[...] or policy='...' (with schedule "
                "none, uniform or block for the layers recomputed whole), or schedule='optimized' with "
                "budget_bytes (the op-level optimum)")

    def _check_types(self) -> None:
        if self.compiler not in COMPILERS:
            raise InvalidBackendOption(f"compiler={self.compiler!r} is not one of {', '.join(COMPILERS)}")
        if self.layers is not None and not isinstance(self.layers, str):
            raise InvalidBackendOption(
                f"layers must be a module path such as 'transformer.h', got {self.layers!r}"
            )
        if self.report_dir is not None and not isinstance(self.report_dir, (str, os.PathLike)):
            raise InvalidBackendOption(f"report_dir must be a folder path, got {self.report_dir!r}")
        if not isinstance(self.calibrate, bool):
            raise InvalidBackendOption(f"calibrate must be True or False, got {self.calibrate!r}")
        if self.on_error not in ON_ERROR:
            raise InvalidBackendOption(f"on_error={self.on_error!r} is not one of {', '.join(ON_ERROR)}")

    def _check_schedule(self) -> None:
        if self.schedule not in SCHEDULES:
            raise InvalidSchedule(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.budget_bytes is not None and self.schedule != "optimized":
            raise InvalidSchedule(
                f"budget_bytes={self.budget_bytes!r} applies only to schedule='optimized'; "
                f"schedule={self.schedule!r} takes recompute_num_layers"
            )
        k = self.recompute_num_layers
        if self.schedule in ("uniform", "block"):
            low = 1 if self.schedule == "uniform" else 0
            name = "K" if self.schedule == "uniform" else "N"
            if k is None:
                raise InvalidSchedule(
                    f"schedule={self.schedule!r} needs recompute_num_layers={name}, an integer in {low}..L "
                    f"(L: the layers of the stack; Megatron-LM's --recompute-num-layers), and none was given: "
                    f"e.g. backend(schedule={self.schedule!r}, recompute_num_layers=1)"
                )
            if not isinstance(k, int) or isinstance(k, bool) or k < low:
                raise InvalidSchedule(
                    f"{self.schedule} needs recompute_num_layers={name}, an integer in {low}..L "
                    f"(L: the layers of the stack); got {k!r}"
                )
        if isinstance(self.budget_bytes, str):
            object.__setattr__(self, "budget_bytes", _budget_from_text(self.budget_bytes))
        if self.schedule == "optimized":
            b = self.budget_bytes
            if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
                raise InvalidSchedule(
                    "schedule='optimized' needs budget_bytes, the peak activation bytes "
                    f"allowed for the step, an integer > 0 or a size such as '80MiB'; got {b!r}"
                )
    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "BackendOptions":
        """From ``torch.compile(options=...)``; ``num_layers`` (the old name of
        ``recompute_num_layers``) is accepted with a DeprecationWarning.

        Raises:
            InvalidBackendOption: a key outside ``OPTION_KEYS``.
            InvalidSchedule: as the constructor.
        """
        options = dict(options or {})
        for old, new in DEPRECATED_KEYS.items():
            if old in options:
                warnings.warn(f"remat backend option {old!r} is deprecated (it is K or N, not the number of "
                              f"layers L); use {new!r}", DeprecationWarning, stacklevel=3)
                options.setdefault(new, options.pop(old))
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise InvalidBackendOption(
                f"unknown remat backend option(s) {unknown}; the options are {', '.join(OPTION_KEYS)}"
            )
        if options.get("granularity") == "op" and "schedule" not in options:
            options["schedule"] = default_op_schedule(options.get("budget_bytes"))
        return cls(**options)

    @property
    def op_level(self) -> bool:
        """Whether the backend builds op-level partitions."""
        return self.granularity == "op"

    def make_schedule(self, num_layers: int) -> schedules.Schedule:
        """The Schedule for a stack of ``num_layers`` layers (``none`` for
        ``optimized``, which the backend solves per graph).

        Raises:
            InvalidSchedule: K / N outside the range L allows (the message names L).
        """
        if num_layers == 0 or self.schedule in ("none", "optimized"):
            return schedules.none(num_layers)
        return schedules.make(self.schedule, self.recompute_num_layers, num_layers)


def default_op_schedule(budget_bytes: int | None) -> str:
    """The schedule of ``granularity="op"`` when none is named: ``optimized`` (the
    op-level optimum) with a budget, else ``none`` (the policy in every layer)."""
    return "optimized" if budget_bytes is not None else "none"


def _budget_from_text(text: str) -> int:
    """A budget written as a size with a unit (``"80MiB"``) as bytes.

    Raises:
        InvalidSchedule: no unit (``"80"``: bytes or MiB?), or not a size.
    """
    if not re.search(r"[A-Za-z]\s*$", text):
        raise InvalidSchedule(
            f"budget_bytes={text!r} has no unit: give an int of bytes or a size with a unit "
            "such as '80MiB', '1.5GB' (units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise InvalidSchedule(f"budget_bytes={text!r}: {e}") from e


def check_compile_kwargs(kwargs: dict[str, Any], given_to: str) -> None:
    """Refuse what ``torch.compile`` passes a backend that it does not support:
    ``mode`` other than ``"default"`` (the modes tune Inductor: CUDA graphs, autotuning)
    and ``options`` given to a backend object (they belong in ``given_to``).

    Raises:
        InvalidBackendOption: naming what was given and what is allowed.
    """
    kwargs = dict(kwargs)
    mode = kwargs.pop("mode", None)
    options = kwargs.pop("options", None)
    if mode not in COMPILE_MODES:
        raise InvalidBackendOption(
            f"torch.compile(mode={mode!r}) is not supported by the remat backend (its modes tune "
            "Inductor: 'reduce-overhead' uses CUDA graphs, 'max-autotune' searches kernels); use "
            f"mode='default' or no mode, and choose the compiler with compiler='eager' | 'inductor' "
            f"in {given_to}")
    if options:
        raise InvalidBackendOption(
            f"torch.compile(options={options!r}) with a remat backend object: give the options to "
            f"{given_to} (its keys: {', '.join(OPTION_KEYS)})")
    if kwargs:
        raise InvalidBackendOption(f"unexpected torch.compile arguments {sorted(kwargs)} for the remat backend")
