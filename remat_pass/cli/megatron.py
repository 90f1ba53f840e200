"""``remat-pass megatron [sweep options] -- <Megatron-LM arguments>``: a Megatron-LM
launch command in, every recompute setting of the Megatron-Core model it describes out.

The arguments after ``--`` are those a user passes to Megatron-LM's ``pretrain_gpt.py``
(read by ``models.megatron_args``: Megatron's names and defaults; an option not modelled
yet or unknown is an error naming it, exit 2). They build Megatron-Core's own
``GPTModel`` (``models.megatron.megatron_gpt``: the local layer spec, unmodified, on the
CPU over a gloo world of one), which is then swept as ``remat-pass sweep`` sweeps a
factory: every setting Megatron-LM can name (none, ``--recompute-method uniform`` with
every K, ``block`` with every N), predicted and, unless ``--meta``, measured, with
gradients checked; the rows of a K that Megatron-Core 0.16.1 itself crashes on are
named; under the table, Megatron-LM's own estimate of the command
(``models.megatron_formula``) and what it leaves out. The options before ``--`` are ``sweep``'s (``--json``, ``--meta``, ``--target``,
``--device-memory``, ``--optimizer``, ...).

Tensor parallelism (``--tensor-model-parallel-size t``): the model is built as one TP
rank builds it (its shards of every column- and row-parallel linear and of the
vocabulary), on a fake process group of world size t in this process
(``setup_megatron_cpu``); every TP rank of it has the same shapes, so the rows are each
rank's. Measured on that fake group, the collectives move no data (their outputs are
allocated as on a real group; a real backend's own buffers are not counted); the
rewrite's gradients are checked against the same model's un-rewritten step on that
group. Pipeline and context parallel sizes of 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..models.megatron_args import read_megatron_command
from ..models.megatron_formula import MegatronEstimate, megatron_estimate

FACTORY = "remat_pass.models.megatron:megatron_gpt"


def add_megatron_parser(sub: Any) -> None:
    """Add the ``megatron`` subcommand (``sweep``'s options, then the Megatron-LM
    arguments after ``--``) to the subparsers ``sub``."""
    from .common import add_model_args
    from .parallel import add_parallel_args
    from .sweep import add_policy_args

    p = sub.add_parser("megatron", help="a Megatron-LM launch command (after --): every recompute setting of its "
                       "Megatron-Core model", usage="remat-pass megatron [sweep options] -- <Megatron-LM arguments>")
    add_model_args(p)
    add_policy_args(p)
    add_parallel_args(p)
    p.add_argument("--allocator", choices=("cpu", "cuda"), help="allocator model for the predicted bytes")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("megatron_args", nargs="*", metavar="MEGATRON-LM ARGUMENTS",
                   help="after --: the arguments of pretrain_gpt.py (--num-layers ... --recompute-method ...)")
    p.set_defaults(func=cmd_megatron)


def cmd_megatron(args: argparse.Namespace) -> int:
    """Read the Megatron-LM arguments, then sweep the model they describe (``cmd_sweep``).

    Raises:
        ValueError: the Megatron-LM arguments (``read_megatron_command``), or ``--model``
            / ``--config`` / ``--batch`` / ``--seq`` / ``--layers`` given as well (the
            command gives them), or ``--tp`` / ``--pp`` / ``--fsdp`` (the command gives
            the parallel sizes).
    """
    from .sweep import cmd_sweep

    for name in ("model", "config", "batch", "seq", "layers"):
        if getattr(args, name, None) is not None:
            raise ValueError(f"remat-pass megatron takes the model from the Megatron-LM arguments after --; "
                             f"leave out --{name}")
    from .parallel import parallel_config

    if parallel_config(args) is not None:
        raise ValueError("remat-pass megatron takes the parallel sizes from the Megatron-LM arguments: leave out "
                         "--tp / --sp / --pp / --fsdp and give --tensor-model-parallel-size after --")
    if not args.megatron_args:
        raise ValueError("give the Megatron-LM arguments after --, e.g. remat-pass megatron -- --num-layers 8 "
                         "--hidden-size 256 --num-attention-heads 4 --seq-length 128 --vocab-size 512 "
                         "--micro-batch-size 8")
    command = read_megatron_command(args.megatron_args)
    args.model, args.batch, args.seq = FACTORY, command.batch, command.seq
    args.layers = command.factory_kwargs["layers"]
    args.factory_kwargs = {k: v for k, v in command.factory_kwargs.items() if k != "layers"}
    method, k = command.recompute
    tp = command.factory_kwargs.get("tensor_parallel", 1)
    setting = "none" if method == "none" else f"{method}({'K' if method == 'uniform' else 'N'}={k})"
    print(f"Megatron-LM command: Megatron-Core GPTModel (local spec), {command.factory_kwargs['layers']} layers, "
          f"hidden {command.factory_kwargs['hidden']}, {command.factory_kwargs['heads']} heads, padded vocab "
          f"{command.factory_kwargs['vocab']}, micro-batch {command.batch}, seq {command.seq}"
          + (f"; tensor-parallel size {tp}: one TP rank's shards (every TP rank alike), on a fake process group "
             "of that world size in this process (collectives move no data)" if tp > 1 else "")
          + "; its recompute "
          f"setting: {setting} (the table's row {setting}); {command.microbatches} microbatch(es) per step, "
          "run one after another (each peaks alike: one microbatch's figures below)", file=sys.stderr)
    if command.ignored:
        print(f"ignored (no effect on one step's memory): {', '.join(command.ignored)}", file=sys.stderr)
    args.megatron_formula = megatron_estimate(command)
    rc = cmd_sweep(args)
    print(formula_lines(args.megatron_formula))
    return rc


def formula_lines(e: MegatronEstimate) -> str:
    """Megatron-LM's own estimate of the command, as printed under the sweep's table,
    with one line per difference from the table's figures."""
    from ..formatting import fmt_bytes

    lines = [f"Megatron-LM's own estimate for this command (report_theoretical_memory, Korthikanti et al. 2022), "
             f"the same for every row: weight and optimizer {fmt_bytes(e.weight_and_optimizer_bytes)} "
             f"({e.parameters:,} parameters x 18 B), activations {fmt_bytes(e.activation_bytes)}, total "
             f"{fmt_bytes(e.total_bytes)}. Against the rows above:"]
    lines += [f"  - {d}" for d in e.leaves_out]
    return "\n".join(lines)
