"""The liveness of Inductor's generated wrapper code (``inductor_memory.run_code``) on
a hand-written ``call`` body, counted by hand: allocations, a buffer reused in place,
``del`` at the last use, a fallback kernel's output sized from its assert, returned
buffers held to the end. No compile needed (the end-to-end checks against measured
steps are the slow Inductor tests of ``test_backend_step.py``)."""

from __future__ import annotations

import pytest

from remat_pass.compile.inductor_memory import run_code
from remat_pass.graph.op_scratch import flash_attention_bytes
from remat_pass.liveness.timeline import live_timeline

CODE = '''
def call(args):
    primals_1, primals_2 = args
    args.clear()
    assert_size_stride(primals_1, (4, 8), (8, 1))
    assert_size_stride(primals_2, (8, 8), (8, 1))
    buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
    extern_kernels.mm(primals_1, primals_2, out=buf0)
    buf1 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
    cpp_fused_relu_0(buf0, buf1)
    buf2 = buf0; del buf0  # reuse
    cpp_fused_mul_1(buf1, buf2)
    del buf1
    buf3 = torch.ops.aten.addmm.default(primals_2, buf2, primals_2)
    assert_size_stride(buf3, (4, 8), (8, 1))
    buf4 = empty_strided_cpu((2, 3), (3, 1), torch.int64)
    cpp_fused_argmax_2(buf3, buf4)
    del buf4
    return (buf2, buf3, )
'''


def test_wrapper_code_by_hand():
    run = run_code(CODE, threads=1)
    assert run.steps == ["alloc buf0", "extern_kernels.mm", "alloc buf1", "cpp_fused_relu_0", "cpp_fused_mul_1",
                         "buf3 = torch.ops.aten.addmm.default", "alloc buf4", "cpp_fused_argmax_2"]
    spans = {s.name: (s.nbytes, s.first, s.last, s.kind) for s in run.storages if not s.static}
    assert spans == {
        "buf0": (128, 0, 7, "buffer"),  # reused as buf2, returned: to the end
        "buf1": (128, 2, 4, "buffer"),  # del after its last use
        "buf3": (128, 5, 7, "fallback output"),  # size from assert_size_stride, returned
        "buf4": (48, 6, 7, "buffer"),
    }
    assert sorted(run.inputs) == ["primals_1", "primals_2"]
    assert [run.storages[s].name for s in run.returns] == ["buf0", "buf3"]

    class _Iv:  # what live_timeline sweeps
        storages, num_steps = run.storages, len(run.steps)

    assert live_timeline(_Iv()) == [128, 128, 256, 256, 256, 256, 304, 304]


def test_sdpa_scratch_formula():
    """Flash-attention CPU scratch (``op_scratch.flash_attention_bytes``, what the
    fallback kernels of Inductor's code are charged): per thread a qSplit x kvSplit score
    block plus max, sum and an output block (forward), two score blocks and a row
    (backward)."""
    assert flash_attention_bytes(128, 128, 32, 4, 1, backward=False) == (32 * 128 + 2 * 32 + 32 * 32) * 4
    assert flash_attention_bytes(128, 128, 32, 4, 2, backward=True) == 2 * 2 * 32 * 128 * 4 + 32 * 4
    assert flash_attention_bytes(1024, 1024, 64, 2, 1, backward=False) == (
        (256 * 512 + 2 * 256 + 256 * 64) * 4 + 256 * 512 * 2)


def test_not_wrapper_code_is_refused():
    with pytest.raises(ValueError, match="def call"):
        run_code("print('hello')")
