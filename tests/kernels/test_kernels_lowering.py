"""Every Pallas kernel lowers to Triton IR at the K3.1 shapes, on a CPU-only host.

`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` under an abstract H200 runs the
Pallas -> Triton lowering (power-of-two tiles, supported primitives, 2-D dots, gathers and
masked stores) without a GPU. It does not compile the Triton IR to PTX nor run it: that, and
performance, need the device (benchmarks/gpu_kernels.py).
"""

import jax
import jax.numpy as jnp
import pytest

from k31jax.kernels._common import lower_for_gpu
from k31jax.ops import _indexer, _kda, _mla, _moe
from k31jax.ops._moe import MXFP4Weight

TRITON = "__gpu$xla.gpu.triton"
# jax 0.12 warns that Pallas-Triton is deprecated (in favour of Mosaic GPU) when lowering for GPU
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
sd = jax.ShapeDtypeStruct


def lowered(fn, *args) -> str:
    try:
        return lower_for_gpu(fn, *args)
    except NotImplementedError as e:  # a jax without abstract GPU devices
        pytest.skip(str(e))


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_chunk_lowers(lower_bound):
    x = sd((1, 200, 96, 128), jnp.bfloat16)
    args = (x, x, x, sd((1, 200, 96, 128), jnp.float32), sd((1, 200, 96), jnp.float32),
            sd((1, 96, 128, 128), jnp.float32))
    txt = lowered(lambda *a: _kda.kda_chunked(*a, 64, impl="pallas", lower_bound=lower_bound), *args)
    assert txt.count(TRITON) == 2
    if lower_bound is not None:  # the 3xTF32 variant benchmarked on the GPU
        from k31jax.kernels.kda_chunk import kda_chunked

        txt = lowered(lambda *a: kda_chunked(*a, 64, lower_bound=lower_bound, impl="pallas",
                                             precision="tf32x3"), *args)
        assert txt.count(TRITON) == 2


def test_kda_decode_step_lowers():
    x = sd((4, 1, 96, 128), jnp.float32)
    txt = lowered(lambda *a: _kda.kda_recurrent(*a, impl="pallas"), x, x, x, x,
                  sd((4, 1, 96), jnp.float32), sd((4, 96, 128, 128), jnp.float32))
    assert txt.count(TRITON) == 1


@pytest.mark.parametrize("t", [1, 3])
def test_sparse_mla_lowers(t):
    b, h, s, k = 2, 96, 4096, 2048
    bf = jnp.bfloat16
    args = (sd((b, t, h, 128), bf), sd((b, t, h, 64), bf), sd((b, s, 512), bf), sd((b, s, 64), bf),
            sd((512, h, 128), bf), sd((512, h, 128), bf), sd((b, t, k), jnp.int32),
            sd((b, t, k), jnp.bool_))
    txt = lowered(lambda *a: _mla.mla_attention_sparse(*a, 192 ** -0.5, impl="pallas"), *args)
    assert txt.count(TRITON) == 1


def test_indexer_decode_lowers():
    f32 = jnp.float32
    args = (sd((2, 1, 64, 128), f32), sd((2, 1, 64), f32), sd((2, 4096, 128), f32),
            sd((1,), jnp.int32), sd((2, 4096), jnp.bool_))
    txt = lowered(lambda *a: _indexer.select_topk(*a, 2048, impl="pallas"), *args)
    assert txt.count(TRITON) == 1


def test_mxfp4_routed_experts_lowers():
    e, d, f, n, top = 896, 3584, 3072, 64, 16
    w_in = MXFP4Weight(sd((e, f, d // 2), jnp.uint8), sd((e, f, d // 32), jnp.uint8))
    w_out = MXFP4Weight(sd((e, d, f // 2), jnp.uint8), sd((e, d, f // 32), jnp.uint8))
    args = (sd((n, d), jnp.bfloat16), sd((n, top), jnp.int32), sd((n, top), jnp.float32),
            w_in, w_in, w_out)
    txt = lowered(lambda *a: _moe.routed_experts(*a, kernels="pallas"), *args)
    assert txt.count(TRITON) == 2  # fused gate/up, then down
