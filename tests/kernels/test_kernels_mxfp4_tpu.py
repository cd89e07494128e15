"""The Pallas TPU (Mosaic) MXFP4 grouped matmul: in TPU interpret mode on CPU against the XLA
op and a float64 decode written from the spec, its tile schedule against a plain reading of its
rules, and compiled by libtpu for v5e / v5p / v6e / tpu7x (skipped with the reason without it).

Awkward cases: experts with zero tokens (first, middle, last), a group longer than a row block,
one row, rows outside every group (padding: 0, as `ragged_dot`), K whose scale blocks are not a
multiple of 8 (padded scale rows), a layer stack read at a row, duplicate experts in one
token's top-k, the 0xFF (NaN) scale byte.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.mx import f64_gmm, f64_weight

from k31jax import aot
from k31jax.kernels.mxfp4_matmul import mosaic_mxfp4_gmm as mm
from k31jax.ops import _moe
from k31jax.ops._moe import MXFP4Weight
from k31jax.quant import kernel_layout, kernel_scale_rows

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu not installed (pip install 'k31jax[tpu]')")


def one_chip(topology):
    """`spec(shape, dtype)`: an abstract argument on one chip of a deviceless TPU topology."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rep = NamedSharding(Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",)), P())
    return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)


def weight(rng, e, n, k, lead=()):
    packed = rng.integers(0, 256, (*lead, e, n, k // 2)).astype(np.uint8)
    scale = rng.integers(118, 136, (*lead, e, n, k // 32)).astype(np.uint8)
    return packed, scale


def run_kernel(x, pairs, sizes, block_m, row=None):
    weights = [kernel_layout(jnp.asarray(p), jnp.asarray(s)) for p, s in pairs]
    return mm.mxfp4_gmm_tpu(jnp.asarray(x), weights, jnp.asarray(sizes, jnp.int32), block_m=block_m, row=row,
                            interpret=True)


@pytest.mark.parametrize("sizes,k,dtype", [
    ([0, 10, 0, 20, 7], 256, "float32"),      # empty first / middle experts, tiles across groups
    ([0, 0, 40, 0, 0], 384, "bfloat16"),      # one group longer than two row blocks; 12 scale blocks
    ([0, 0, 0, 0, 1], 256, "float32"),        # one row, in the last expert
])
def test_matches_float64_and_the_xla_op(sizes, k, dtype):
    rng = np.random.default_rng(sum(sizes) + k)
    e, n = len(sizes), 256
    packed, scale = weight(rng, e, n, k)
    m = sum(sizes) + 5  # 5 padding rows outside every group
    x = rng.standard_normal((m, k)).astype(dtype)
    (y,) = run_kernel(x, [(packed, scale)], sizes, block_m=16)
    assert y.dtype == x.dtype and y.shape == (m, n)
    y = np.asarray(y, np.float64)
    want = f64_gmm(x, packed, scale, sizes)
    assert np.all(y[sum(sizes):] == 0)
    tol = 1e-6 if dtype == "float32" else 1e-2
    assert np.linalg.norm(y - want) <= tol * np.linalg.norm(want)
    op = _moe.grouped_matmul(jnp.asarray(x), MXFP4Weight(jnp.asarray(packed), jnp.asarray(scale)),
                             jnp.asarray(sizes, jnp.int32))
    # the same dequantised weight, f32 accumulation in another order (bf16: one output ulp)
    op = np.asarray(op, np.float64)
    assert np.linalg.norm(y - op) <= (1e-6 if dtype == "float32" else 4e-3) * np.linalg.norm(op)


def test_layer_stack_row_fused_weights_and_nan_scale():
    """Two weights in one launch read from a 3-layer stack at row 2; a 0xFF scale byte gives NaN
    in its column only."""
    rng = np.random.default_rng(3)
    sizes = [9, 0, 17]
    (pg, sg), (pu, su) = weight(rng, 3, 128, 256, lead=(3,)), weight(rng, 3, 128, 256, lead=(3,))
    sg[2, 0, 5, 1] = 255
    x = rng.standard_normal((sum(sizes), 256)).astype(np.float32)
    g, u = run_kernel(x, [(pg, sg), (pu, su)], sizes, block_m=8, row=jnp.int32(2))
    want_g, want_u = f64_gmm(x, pg[2], sg[2], sizes), f64_gmm(x, pu[2], su[2], sizes)
    g = np.asarray(g, np.float64)
    assert np.isnan(g[:9, 5]).all() and np.isfinite(np.delete(g, 5, axis=1)).all()
    for got, want in ((np.delete(g, 5, axis=1), np.delete(want_g, 5, axis=1)), (np.asarray(u, np.float64), want_u)):
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


def test_routed_experts_through_the_seam_with_duplicate_experts():
    """`routed_experts(kernels="interpret_tpu")` (the fused gate/up launch, then down) equals the
    ragged XLA path, with one token choosing the same expert twice."""
    rng = np.random.default_rng(11)
    n_tok, top, d, f, e = 7, 2, 256, 128, 6
    idx = np.stack([rng.choice(e, top, replace=False) for _ in range(n_tok)]).astype(np.int32)
    idx[3] = [4, 4]
    wts = jnp.asarray(rng.random((n_tok, top)), jnp.float32)
    ws = [MXFP4Weight(*map(jnp.asarray, weight(rng, e, *shape))) for shape in ((f, d), (f, d), (d, f))]
    x = jnp.asarray(rng.standard_normal((n_tok, d)) * 0.3, jnp.bfloat16)
    run = jax.jit(_moe.routed_experts, static_argnames=("form", "kernels"))
    y = run(x, jnp.asarray(idx), wts, *ws, kernels="interpret_tpu")
    y_x = run(x, jnp.asarray(idx), wts, *ws, form="ragged")
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_x, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("sizes,k,dtype,block_m", [
    ([0, 10, 0, 20, 7], 256, "float32", 16),    # empty first / middle experts, tiles across groups
    ([0, 0, 40, 0, 0], 384, "float32", 16),     # one group longer than two row blocks; 12 scale blocks
    ([0, 0, 0, 0, 1], 256, "bfloat16", 8),      # one row, in the last expert
])
def test_activation_gradient_matches_float64_and_the_xla_op(sizes, k, dtype, block_m):
    """`mxfp4_gmm_dx_tpu`: dx = dy_gate W_gateᵀ + dy_up W_upᵀ per row's expert (the fused gate/up
    launch's gradient), from a 2-layer stack at row 1; padding rows get zero."""
    rng = np.random.default_rng(sum(sizes) * 7 + k)
    e, n = len(sizes), 256
    (pg, sg), (pu, su) = weight(rng, e, n, k, lead=(2,)), weight(rng, e, n, k, lead=(2,))
    m = sum(sizes) + 5
    dg, du = (rng.standard_normal((m, n)).astype(dtype) for _ in range(2))
    pairs = [kernel_layout(jnp.asarray(p), jnp.asarray(s)) for p, s in ((pg, sg), (pu, su))]
    dx = jax.jit(lambda a, b: mm.mxfp4_gmm_dx_tpu([a, b], pairs, jnp.asarray(sizes, jnp.int32), block_m=block_m,
                                                  row=jnp.int32(1), interpret=True))(dg, du)
    assert dx.dtype == dg.dtype and dx.shape == (m, k)
    ends = np.cumsum(sizes)
    want = np.zeros((m, k))
    for j, (lo, hi) in enumerate(zip(ends - sizes, ends)):
        for dy, (p, s) in ((dg, (pg, sg)), (du, (pu, su))):
            want[lo:hi] += np.asarray(dy[lo:hi], np.float64) @ f64_weight(p[1, j], s[1, j])
    got = np.asarray(dx, np.float64)
    assert np.all(got[sum(sizes):] == 0)
    tol = 1e-6 if dtype == "float32" else 1e-2
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)
    x = jnp.zeros((m, k), dtype)
    wg, wu = (MXFP4Weight(jnp.asarray(p[1]), jnp.asarray(s[1])) for p, s in ((pg, sg), (pu, su)))
    sz = jnp.asarray(sizes, jnp.int32)
    _, vjp = jax.vjp(lambda x_: (_moe.grouped_matmul(x_, wg, sz), _moe.grouped_matmul(x_, wu, sz)), x)
    (op,) = vjp((jnp.asarray(dg), jnp.asarray(du)))
    op = np.asarray(op, np.float64)
    assert np.linalg.norm(got - op) <= (1e-6 if dtype == "float32" else 4e-3) * np.linalg.norm(op)


def test_training_through_the_seam_takes_the_kernels_own_gradient():
    """`jax.grad` of `routed_experts(kernels="interpret_tpu")` with respect to the tokens runs the
    transposed kernel (not the XLA path's backward) and equals the ragged XLA path's gradient."""
    rng = np.random.default_rng(12)
    n_tok, top, d, f, e = 9, 2, 256, 128, 6
    idx = jnp.asarray(np.stack([rng.choice(e, top, replace=False) for _ in range(n_tok)]).astype(np.int32))
    wts = jnp.asarray(rng.random((n_tok, top)), jnp.float32)
    ws = [MXFP4Weight(*map(jnp.asarray, weight(rng, e, *shape))) for shape in ((f, d), (f, d), (d, f))]
    x = jnp.asarray(rng.standard_normal((n_tok, d)) * 0.3, jnp.float32)
    probe = jnp.asarray(rng.standard_normal((n_tok, d)), jnp.float32)

    def loss(x_, **kw):
        return jnp.sum(_moe.routed_experts(x_, idx, wts, *ws, **kw) * probe)

    grad = jax.grad(functools.partial(loss, kernels="interpret_tpu"))
    traced = str(jax.make_jaxpr(grad)(x))
    assert "name=mxfp4_gmm_dx_tpu" in traced and "ragged_dot" not in traced
    want = np.asarray(jax.grad(functools.partial(loss, form="ragged"))(x), np.float64)
    got = np.asarray(grad(x), np.float64)
    # f32 sums in another order in both passes; the SiLU gate's derivative at these weights' large
    # pre-activations magnifies the forward's rounding (the dx launch alone agrees to 1e-6, above)
    assert np.linalg.norm(got - want) <= 2e-4 * np.linalg.norm(want)


def test_dx_cost_estimate_counts_the_blockspecs():
    est = mm.dx_cost_estimate(m_pad=32, k=256, n=512, n_experts=4, n_w=2, itemsize=2, block_m=16, block_n=256)
    tiles = 2 + 4                                   # one per row block, plus one per expert reached
    weights = 2 * tiles * 512 * (128 + 8)           # each tile reads its expert's words and scale rows
    dy = 2 * tiles * 16 * 512 * 2                   # and its row block of each dy, every column block
    dx = 32 * 256 * 4                               # the f32 planes, once per row block
    assert est.bytes_accessed == weights + dy + dx
    assert est.flops == 2 * 2 * tiles * (2 * 16 * 256 * 256 + 2 * 32 * 8 * 256)


def test_fp8_mxu_inputs_on_mxfp8_activations():
    """`mxu="fp8"` (e4m3 on both MXU sides) on MXFP8 activations equals float64 and the bf16 path
    to f32 accumulation and the rounding of values 2^16 below their row's largest (at most 2^-17
    of it); a column whose block scales span more than 8 octaves, and a NaN scale, make their
    tile take the bf16 path: equal to it exactly."""
    from k31jax.quant import mx_fake_quant_activations

    rng = np.random.default_rng(21)
    sizes, k, n = [0, 10, 0, 20, 7], 256, 256
    packed, scale = weight(rng, len(sizes), n, k)
    scale = (scale % 8 + 120).astype(np.uint8)  # each column's block scales within 8 octaves
    m = sum(sizes) + 5
    raw = jnp.asarray(rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 6, (m, 1))), jnp.bfloat16)
    x = mx_fake_quant_activations(raw, "e4m3", "rceil").astype(jnp.bfloat16)
    x8, shift = mm._fp8_rows(mm.x_planes(x, m))
    rounded = np.stack([np.asarray(a.astype(jnp.float32)) for a in x8]) * np.asarray(shift)
    exact = np.asarray(mm.x_planes(x, m), np.float32)
    row_max = np.abs(exact).max(axis=(0, 2), keepdims=True)
    assert np.all(np.abs(rounded - exact) <= 2.0 ** -17 * row_max)

    def run(p, sc, mxu):
        (y,) = jax.jit(lambda v: mm.mxfp4_gmm_tpu(v, [kernel_layout(jnp.asarray(p), jnp.asarray(sc))],
                                                  jnp.asarray(sizes, jnp.int32), block_m=16, interpret=True,
                                                  out_dtype=jnp.float32, mxu=mxu))(x)
        return np.asarray(y, np.float64)

    want = f64_gmm(x, packed, scale, sizes)
    fp8, bf16 = run(packed, scale, "fp8"), run(packed, scale, "bf16")
    assert not np.array_equal(fp8, bf16)  # the fp8 path ran
    assert np.linalg.norm(fp8 - want) <= 1e-5 * np.linalg.norm(want)
    assert np.linalg.norm(fp8 - bf16) <= 1e-5 * np.linalg.norm(want)
    spread = scale.copy()
    spread[:, 7, 0] = 100  # column 7's first block 2^-27, its others 2^-7..2^0
    spread[:, 9, 1] = 255  # NaN
    a, b = run(packed, spread, "fp8"), run(packed, spread, "bf16")
    np.testing.assert_array_equal(a, b)
    assert np.isnan(a[:sum(sizes), 9]).all()
    with pytest.raises(ValueError, match=r"mxu='int8', expected one of \('bf16', 'fp8'\)"):
        mm.mxfp4_gmm_tpu(x, [kernel_layout(jnp.asarray(packed), jnp.asarray(scale))],
                         jnp.asarray(sizes, jnp.int32), block_m=16, interpret=True, mxu="int8")


@needs_libtpu
def test_fp8_mxu_inputs_only_where_the_mxu_takes_fp8():
    """`mxu_inputs`: fp8 for MXFP8 activations on TPU7x (the generation whose MXU multiplies fp8),
    bf16 on v5e / v5p / v6e, for bf16 activations, and on this CPU host."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from k31jax.kernels.mxfp4_matmul import mxu_inputs

    chosen = {}
    for topology in ("v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"):
        mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            chosen[topology] = (mxu_inputs(True), mxu_inputs(False))
    assert chosen == {"v5e:2x2": ("bf16", "bf16"), "v5p:2x2x1": ("bf16", "bf16"), "v6e:2x2": ("bf16", "bf16"),
                      "tpu7x:2x2x1": ("fp8", "bf16")}
    assert mxu_inputs(True) == "bf16"  # no TPU here
    # inside the expert-parallel shard_map of a program built for a TPU7x slice, as `k31jax.aot` builds it
    mesh = Mesh(np.asarray(aot.tpu_devices("tpu7x:2x2x1")), ("x",))
    inside = []
    with jax.set_mesh(mesh):
        jax.jit(jax.shard_map(lambda a: inside.append(mxu_inputs(True)) or a, in_specs=P("x"), out_specs=P("x"))
                ).trace(jax.ShapeDtypeStruct((8,), jnp.float32))
    assert inside == ["fp8"]


def schedule_reference(sizes, m, bm):
    """The schedule's rules read plainly: (row block, expert) pairs that intersect, in row
    order; one empty tile per row block no group reaches; the rest repeat the last one."""
    tiles, start = [], 0
    for e, n in enumerate(sizes):
        for b in range(start // bm, -(-(start + n) // bm) if n else 0):
            tiles.append((e, b, max(start, b * bm), min(start + n, (b + 1) * bm)))
        start += n
    last_e = tiles[-1][0] if tiles else 0
    tiles += [(last_e, b, 0, 0) for b in range(-(-start // bm), -(-m // bm))]
    n_tiles = max(-(-m // bm) + min(len(sizes), m) - 1, 1)
    assert len(tiles) <= n_tiles
    tiles += [(tiles[-1][0], tiles[-1][1], 0, 0)] * (n_tiles - len(tiles))
    fresh = [int(i < len(tiles) and (i == 0 or t[1] != tiles[i - 1][1])) for i, t in enumerate(tiles)]
    return tiles, fresh


@pytest.mark.parametrize("seed", range(6))
def test_tile_schedule(seed):
    rng = np.random.default_rng(seed)
    e = int(rng.integers(1, 9))
    sizes = [int(s) for s in rng.integers(0, 30, e) * (rng.random(e) < 0.6)]
    m, bm = sum(sizes) + int(rng.integers(0, 20)), int(rng.choice([8, 16]))
    m = max(m, 1)
    grp, blk, lo, hi, fresh = map(np.asarray, mm.tpu_tile_schedule(jnp.asarray(sizes, jnp.int32), m, bm))
    tiles, want_fresh = schedule_reference(sizes, m, bm)
    used = sum(1 for t in tiles if t[3] > t[2]) + len(range(-(-sum(sizes) // bm), -(-m // bm)))
    got = list(zip(grp.tolist(), blk.tolist(), lo.tolist(), hi.tolist()))
    assert got[:used] == tiles[:used]
    # unused tiles repeat the last used tile's expert and row block (no DMA) and do nothing
    assert all(t[:2] == got[used - 1][:2] and t[2] == t[3] == 0 for t in got[used:])
    assert fresh[:used].tolist() == want_fresh[:used] and not fresh[used:].any()
    # every row block is zero-filled exactly once
    assert sorted(blk[fresh == 1].tolist()) == list(range(-(-m // bm)))


def test_cost_estimate_counts_the_blockspecs():
    bound = mm.cost_estimate(m_pad=32, k=256, n=512, n_experts=4, n_w=2, itemsize=2, block_m=16, block_n=256)
    weights = 2 * 4 * 512 * (128 + 8)              # every expert's words and scale rows, once
    x = 2 * 32 * 256 * 2                           # each row block of x once per column block
    out = 2 * 32 * 512 * 2
    assert bound.bytes_accessed == weights + x + out
    tile = 2 * 16 * 256 * 256 + 2 * 32 * 8 * 256   # products and the scale widening, one tile
    assert bound.flops == 2 * 2 * (2 + 4) * tile
    # 3 rows expected in groups of 64 experts: the expected distinct experts, not all of them
    few = mm.cost_estimate(m_pad=32, k=256, n=512, n_experts=64, n_w=1, itemsize=2, block_m=16, block_n=512,
                           out_itemsize=4, rows=3)
    reached = 64 * (1 - (1 - 1 / 64) ** 3)
    assert few.bytes_accessed == int(reached * 512 * 136 + 32 * 256 * 2 + 32 * 512 * 4)


def test_bad_inputs_name_what_was_expected():
    x = jnp.zeros((4, 256), jnp.bfloat16)
    words, scale = kernel_layout(jnp.zeros((2, 64, 128), jnp.uint8), jnp.zeros((2, 64, 8), jnp.uint8))
    with pytest.raises(ValueError, match="x has 128 columns, the words hold 256"):
        mm.mxfp4_gmm_tpu(x[:, :128], [(words, scale)], jnp.ones(2, jnp.int32), block_m=8, interpret=True)
    with pytest.raises(ValueError, match=r"expected uint8 scale rows \(2, 1, 8, 64\)"):
        mm.mxfp4_gmm_tpu(x, [(words, scale[:, :, :4])], jnp.ones(2, jnp.int32), block_m=8, interpret=True)
    with pytest.raises(ValueError, match="need a layer axis"):
        mm.mxfp4_gmm_tpu(x, [(words, scale)], jnp.ones(2, jnp.int32), block_m=8, row=0, interpret=True)




@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_compiles_for_tpu_reading_the_stack_in_place(topology):
    """libtpu compiles the fused gate/up launch over a layer stack; the stacks reach the kernel
    as they are (no copy of a weight argument) and the temporaries are a few tiles."""
    spec = one_chip(topology)

    layers, e, n, k, m = 1024, 16, 256, 768, 64  # stacks larger than any VMEM (none prefetched whole)
    words = spec((layers, e, k // 8, n), jnp.uint32)
    scale = spec((layers, e, 1, kernel_scale_rows(k // 32), n), jnp.uint8)

    def gate_up(x, sizes, row, wg, sg, wu, su):
        return mm.mxfp4_gmm_tpu(x, [(wg, sg), (wu, su)], sizes, block_m=16, row=row)

    compiled = jax.jit(gate_up).lower(spec((m, k), jnp.bfloat16), spec((e,), jnp.int32), spec((), jnp.int32),
                                      words, scale, words, scale).compile()
    text = compiled.as_text()
    assert "mxfp4_gmm_tpu" in text
    weight_copies = [line for line in text.splitlines()
                     if " copy(" in line and any(f"op_name=\"{a}\"" in line for a in ("wg", "sg", "wu", "su"))]
    assert not weight_copies, weight_copies[0][:200]
    assert compiled.memory_analysis().temp_size_in_bytes < 4 << 20
    # the compile report counts the kernel by its BlockSpec cost estimate, not by the stacks it
    # is handed (1,024 layers x 16 experts, of which it reads at most 16 experts of one layer)
    est = mm.cost_estimate(m, k, n, e, 2, 2, 16, mm.pick_block_n(n))
    report = aot.analyse(text)
    assert report.flops >= est.flops and est.bytes_accessed <= report.hbm_bytes < 2 * est.bytes_accessed
    assert report.hbm_bytes < 2 * layers * e * n * (k // 2)



@needs_libtpu
def test_fp8_mxu_inputs_compile_for_tpu7x():
    """The fused gate/up launch with `mxu="fp8"` (e4m3 operands, the bf16 fall-back beside them)
    compiles for TPU7x at a K3.1 Pro device's decode shapes, from the layer stacks in place."""
    spec = one_chip("tpu7x:2x2x1")

    layers, e, n, k, m = 92, 112, 384, 3584, 128
    words = spec((layers, e, k // 8, n), jnp.uint32)
    scale = spec((layers, e, 1, kernel_scale_rows(k // 32), n), jnp.uint8)

    def gate_up(x, sizes, row, wg, sg, wu, su):
        return mm.mxfp4_gmm_tpu(x, [(wg, sg), (wu, su)], sizes, block_m=16, row=row, mxu="fp8", expected_rows=16)

    compiled = jax.jit(gate_up).lower(spec((m, k), jnp.bfloat16), spec((e,), jnp.int32), spec((), jnp.int32),
                                      words, scale, words, scale).compile()
    est = mm.cost_estimate(m, k, n, e, 2, 2, 16, mm.pick_block_n(n), rows=16)
    kernel = [moved for moved, name in aot.analyse(compiled.as_text()).traffic
              if name.endswith("mxfp4_gmm_tpu/pallas_call")]
    assert kernel == [est.bytes_accessed]
    assert compiled.memory_analysis().temp_size_in_bytes < 4 << 20


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_activation_gradient_compiles_for_tpu_reading_the_stack_in_place(topology):
    """libtpu compiles the fused gate/up dx launch over layer stacks: no copy of a weight
    argument, temporaries a few tiles, and the kernel counted by its BlockSpec estimate."""
    spec = one_chip(topology)

    layers, e, n, k, m = 1024, 16, 256, 768, 64
    words = spec((layers, e, k // 8, n), jnp.uint32)
    scale = spec((layers, e, 1, kernel_scale_rows(k // 32), n), jnp.uint8)

    def dx(dg, du, sizes, row, wg, sg, wu, su):
        return mm.mxfp4_gmm_dx_tpu([dg, du], [(wg, sg), (wu, su)], sizes, block_m=16, row=row)

    compiled = jax.jit(dx).lower(spec((m, n), jnp.bfloat16), spec((m, n), jnp.bfloat16), spec((e,), jnp.int32),
                                 spec((), jnp.int32), words, scale, words, scale).compile()
    text = compiled.as_text()
    weight_copies = [line for line in text.splitlines()
                     if " copy(" in line and any(f"op_name=\"{a}\"" in line for a in ("wg", "sg", "wu", "su"))]
    assert not weight_copies, weight_copies[0][:200]
    assert compiled.memory_analysis().temp_size_in_bytes < 4 << 20
    est = mm.dx_cost_estimate(m, k, n, e, 2, 2, 16, mm.pick_block_n(n))
    kernel = [moved for moved, name in aot.analyse(text).traffic if name.endswith("mxfp4_gmm_dx_tpu/pallas_call")]
    assert kernel == [est.bytes_accessed]


@pytest.mark.parametrize("mesh_spec", ["expert=4,tensor=2"])
def test_model_in_the_kernel_layout_equals_the_byte_model(mesh_spec):
    """The experts held in the kernel layout (`expert_words(kernel=True)`) and run by the Mosaic
    kernel in TPU interpret mode (`kernels="interpret_tpu"`), expert-parallel over 8 CPU devices
    (`w_down`'s scale blocks in two parts over `tensor`; the kernel reads each device's share
    of the layer stacks at the scan's row): prefill then decode give the byte model's XLA
    logits (bf16 activations, one rounding order apart). Five layers: the interpreter is slow."""
    import contextlib

    from flax import nnx

    from k31jax import K31ForCausalLM, ModelConfig, sharding
    from k31jax.distributed import shard_model
    from k31jax.nn import expert_words
    from k31jax.ops import Backends
    from k31jax.quant import MXFP4KernelWeight

    tiny = ModelConfig.preset("tiny")
    cfg = tiny.replace(expert_weights="mxfp4", moe_intermediate_size=256, routed_expert_hidden_size=512,
                       num_hidden_layers=5, layer_types=tiny.layer_types[:5])
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
    if mesh is not None:
        model = shard_model(model, mesh)
    graphdef, state = nnx.split(model)
    held = expert_words(state, kernel=True)
    down = held["moe"]["w_down"]
    splits = 2 if mesh else 1
    assert down["packed"].get_value().dtype == jnp.uint32 and down["scale"].get_value().shape[-3:] == (
        splits, kernel_scale_rows(256 // 32 // splits), 512)
    if mesh is not None:
        assert down["scale"].get_value().sharding.spec[-3] == "tensor"

    def run(st, backends):
        m = nnx.merge(graphdef, st)
        assert isinstance(m.moe.w_down.weight(), MXFP4KernelWeight) == (st is held)
        cache = m.init_cache(batch=2, max_len=32)
        tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 9)), jnp.int32)
        step = jax.jit(lambda t, c: m(t, c, backends=backends))
        ran_kernel = "mxfp4_gmm_tpu" in str(jax.make_jaxpr(lambda t, c: m(t, c, backends=backends))(tokens, cache))
        assert ran_kernel == (st is held)
        prefill = step(tokens, cache)
        decode = step(tokens[:, :1], prefill.cache)
        return np.asarray(prefill.logits, np.float32), np.asarray(decode.logits, np.float32)

    with sharding.activate(mesh) if mesh is not None else contextlib.nullcontext():
        want = run(state, Backends(kernels="xla", moe="ragged"))
        got = run(held, Backends(kernels="interpret_tpu"))
    for g, w in zip(got, want):
        assert np.linalg.norm(g - w) <= 1e-2 * np.linalg.norm(w)
