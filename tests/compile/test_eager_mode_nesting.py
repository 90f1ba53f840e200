"""A backend waiting to record its next step's eager ops never pushes its dispatch mode
inside another mode's ``with`` block: that block's exit would pop the backend's mode and
leave its own on the stack (it did: ``untraceable._FakeCheck`` stayed pushed after a
compiled test in the same process, and later steps ran through it)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import remat_pass
from remat_pass.compile.eager_recorder import pushed_mode, release_modes
from remat_pass.models import tiny_gpt


class Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return func(*args, **(kwargs or {}))


def test_a_waiting_backend_does_not_push_inside_another_mode():
    torch._dynamo.reset()
    model, (ids,), loss_fn = tiny_gpt(batch=2, seq=8, layers=2, hidden=16, heads=2, vocab=32, dropout=0.0)
    cm = torch.compile(model, backend=remat_pass.backend(schedule="uniform", recompute_num_layers=1,
                                                         compiler="eager"))
    loss_fn(cm(ids)).backward()  # the first step of the signature: the backend wants the next one recorded
    release_modes()
    assert pushed_mode() is None
    own = Passing()
    with own:
        x = torch.ones(3, requires_grad=True)
        (x * 2).sum().backward()  # a backward inside another mode: nothing is pushed on top of it
        assert pushed_mode() is None
    assert _get_current_dispatch_mode_stack() == []
    (torch.ones(3, requires_grad=True) * 2).sum().backward()  # outside: the backend pushes its mode
    assert pushed_mode() is not None
    release_modes()
    assert _get_current_dispatch_mode_stack() == []
