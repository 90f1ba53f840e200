"""The zoo's ZooEntry and Refusal, and the inputs, losses and layers its models build on."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from remat_pass.errors import RematError
from remat_pass.evaluate.session import Session

B, T, D = 4, 8, 16
VOCAB = 40

Built = tuple[nn.Module, Any, Callable[[Any], torch.Tensor] | None]
"""What ``ZooEntry.build`` returns: ``(model, example_inputs, loss_fn)``."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The RematError ``Session.create`` must raise for an entry: a model the pass refuses
    with a clear message instead of sweeping it. An entry either sweeps exactly or is
    refused; no entry passes on either outcome.

    Attributes:
        error: the RematError subclass expected.
        match: a regex the message must match (``pytest.raises(match=)``), or None.
    """

    error: type[RematError] = RematError
    match: str | None = None


def refused(error: type[RematError] = RematError, match: str | None = None) -> Refusal:
    """``Session.create`` must raise ``error`` (with a message matching ``match``)."""
    return Refusal(error, match)


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo and what sweeping every Megatron schedule over it must give.

    Attributes:
        name: the test id.
        build: returns ``(model, example_inputs, loss_fn)`` with fresh weights seeded 0.
        exercises: one sentence: what the model exercises.
        num_layers: L, the number of layers of the stack found (None: not checked).
        layers: the ``layers=`` stack path (or paths) given to ``Session.create``
            (None: found automatically).
        expect_stack_path: the path the stack must be found at (None: not checked).
        empty_layers: layers of the stack expected to hold no graph node; any other
            empty layer is a silent miss.
        refusal: the RematError ``Session.create`` must raise (None: the entry must sweep
            every schedule exactly).
        eager_grad_tolerance: largest allowed |grad - eager autograd grad|.
        check: an extra check on the Session after the sweep.
        requires: modules that must be importable (skipped otherwise).
    """

    name: str
    build: Callable[[], Built]
    exercises: str
    num_layers: int | None = None
    layers: str | tuple[str, ...] | None = None
    expect_stack_path: str | None = None
    empty_layers: tuple[int, ...] = ()
    refusal: Refusal | None = None
    eager_grad_tolerance: float = 1e-5
    check: Callable[[Session], None] | None = None
    requires: tuple[str, ...] = ()


# ---- shared helpers -----------------------------------------------------------------


def x(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """A seeded normal tensor, (B, T, D) by default."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*(shape or (B, T, D)), generator=g).to(dtype)


def ids(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Seeded token ids, (B, T) int64."""
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def sq(y: torch.Tensor) -> torch.Tensor:
    """A loss with no Python-scalar ops in its forward or backward."""
    return (y * y).sum()


def seeded(
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[], Any] = lambda: (x(),),
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Callable[[], Built]:
    """A ``build``: the model made after ``torch.manual_seed(0)``, then the inputs."""

    def build() -> Built:
        torch.manual_seed(0)
        return make_model(), make_inputs(), loss_fn

    return build


class Block(nn.Module):
    """Linear -> tanh -> Linear plus residual."""

    def __init__(self, d: int = D, out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, out or d)
        self.res = out is None or out == d

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x)))
        return y + x if self.res else y


class Stack(nn.Module):
    """``blocks`` called in order, loss ``sq`` of the output (or the output itself)."""

    def __init__(self, blocks, return_hidden: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.return_hidden = return_hidden

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x if self.return_hidden else sq(x)


def layers_of(n: int, cls: Callable[[], nn.Module] = Block) -> list[nn.Module]:
    """``n`` fresh layers made by ``cls``."""
    return [cls() for _ in range(n)]


def stack(n: int = 3, cls: Callable[[], nn.Module] = Block) -> Stack:
    """A ``Stack`` of ``n`` layers made by ``cls``."""
    return Stack(layers_of(n, cls))


def stack_of(cls: Callable[[], nn.Module], n: int = 3, **kw) -> Callable[[], Built]:
    """A ``build`` of ``stack(n, cls)`` on one (B, T, D) input (``kw``: see ``seeded``)."""
    return seeded(lambda: stack(n, cls), **kw)


def frozen_stack(n: int) -> Callable[[], Stack]:
    """Makes ``stack(n)`` with every parameter frozen."""
    return lambda: stack(n).requires_grad_(False)


def in_eval(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """Makes ``make()`` in eval mode."""
    return lambda: make().eval()
