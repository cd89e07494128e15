"""The Pallas TPU (Mosaic) sparse MLA attention: in TPU interpret mode on CPU against a float64
reference written from the spec (attention.md §1.3, §3) and the XLA op, through the op's seam
(stacked caches read at a layer, the XLA path's gradient), per device under a mesh of 8 CPU
devices, and compiled by libtpu for v5e / v5p / v6e / tpu7x (skipped with the reason without it).

Awkward cases: top-k = the whole context (every tile touched), a batch of 1, several queries per
row (T = 3, each its own selection), heads / latent / pe widths that are not 8 or 128 (padded
in the launch), a cache length that is not a whole number of tiles, slots that are not
candidates and a query with none (uniform over its slots, as the XLA rule), selections that
touch more tiles than one block holds, bf16 caches.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax import aot
from k31jax.kernels.sparse_mla import latent_attention_sparse_tpu
from k31jax.kernels.sparse_mla import mosaic_sparse_mla as msm
from k31jax.ops import _mla

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu not installed (pip install 'k31jax[tpu]')")


def inputs(seed, b, t, h, dn, dr, r, dv, s, k, layers=None, pe_lanes=None):
    """Distinct selected rows per query (a top-k's), some slots not candidates, query (0, 0)
    with none. With `layers`, the caches are layer stacks (k_pe rows padded to `pe_lanes`)."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    lead = () if layers is None else (layers,)
    k_pe = f(*lead, b, s, pe_lanes or dr)
    if pe_lanes:
        k_pe[..., dr:] = 0.0
    arrays = dict(q_nope=f(b, t, h, dn), q_pe=f(b, t, h, dr), c_kv=f(*lead, b, s, r), k_pe=k_pe,
                  w_uk=f(r, h, dn) * 0.3, w_uv=f(r, h, dv) * 0.3)
    idx = np.stack([np.stack([rng.permutation(s)[:k] for _ in range(t)]) for _ in range(b)]).astype(np.int32)
    valid = rng.random((b, t, k)) > 0.3
    valid[0, 0] = False
    return arrays, idx, valid


def f64_sparse(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid, scale):
    """attention.md §1.3 over the selected rows, float64, one (b, t, h) at a time."""
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (np.asarray(a, np.float64) for a in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    b_, t_, h_, dr = q_pe.shape
    out = np.zeros((b_, t_, h_, w_uv.shape[-1]))
    for b in range(b_):
        for t in range(t_):
            rows_c, rows_p, ok = c_kv[b, idx[b, t]], k_pe[b, idx[b, t], :dr], valid[b, t]
            for h in range(h_):
                logit = (rows_c @ (w_uk[:, h] @ q_nope[b, t, h]) + rows_p @ q_pe[b, t, h]) * scale
                p = np.where(ok, np.exp(logit - logit[ok].max()), 0.0) if ok.any() else np.ones_like(logit)
                out[b, t, h] = w_uv[:, h].T @ ((p / p.sum()) @ rows_c)
    return out


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


CASES = {  # b, t, h, dn, dr, r, dv, s, k, layers, pe_lanes, dtype
    "topk-is-the-context": (1, 1, 3, 16, 8, 24, 16, 37, 37, None, None, "float32"),
    "three-queries-stacked": (2, 3, 5, 16, 64, 128, 16, 124, 64, 3, 128, "float32"),
    "two-blocks-of-tiles-bf16": (2, 1, 8, 16, 64, 128, 16, 1024, 512, 2, 128, "bfloat16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_and_the_xla_op(case):
    b, t, h, dn, dr, r, dv, s, k, layers, pe_lanes, dtype = CASES[case]
    a, idx, valid = inputs(len(case), b, t, h, dn, dr, r, dv, s, k, layers, pe_lanes)
    a["c_kv"], a["k_pe"] = (jnp.asarray(a[n], dtype) for n in ("c_kv", "k_pe"))
    scale = (dn + dr) ** -0.5
    layer = None if layers is None else jnp.int32(layers - 1)

    def op(impl):
        fn = functools.partial(_mla.mla_attention_sparse, scale=scale, impl=impl, layer=layer)
        return jax.jit(lambda *x: fn(*x))(*a.values(), idx, valid)

    fn = functools.partial(_mla.mla_attention_sparse, scale=scale, impl="interpret_tpu", layer=layer)
    assert "sparse_mla_tpu" in str(jax.make_jaxpr(fn)(*a.values(), idx, valid))
    o, o_x = op("interpret_tpu"), op("xla")
    rows = {n: (a[n] if layers is None else np.asarray(a[n], np.float32)[layers - 1]) for n in ("c_kv", "k_pe")}
    o_64 = f64_sparse(a["q_nope"], a["q_pe"], rows["c_kv"], rows["k_pe"], a["w_uk"], a["w_uv"], idx, valid, scale)
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16: the query and the softmax weights in bf16
    assert rel(o, o_64) < tol and rel(o, o_x) < tol
    # the kernel's own answer for the query with no candidate: the uniform average (XLA's rule)
    assert rel(o[0, 0], o_64[0, 0]) < tol


@pytest.mark.parametrize("t,s,k", [(1, 2048, 64), (17, 64, 32)], ids=["long-context", "prefill-chunk"])
def test_long_contexts_and_prefill_keep_the_xla_path(t, s, k):
    """Top-64 of 2,048 fp32 rows: the 64 tiles a scattered selection may touch are 8x its rows
    (> `MAX_TILE_READ`); 17 queries per row (> `MAX_KERNEL_QUERIES`): the op keeps the XLA
    gather; the same values."""
    a, idx, valid = inputs(4, 1, t, 4, 16, 8, 32, 16, s, k)
    fn = functools.partial(_mla.mla_attention_sparse, scale=0.2, impl="interpret_tpu")
    assert "sparse_mla_tpu" not in str(jax.make_jaxpr(fn)(*a.values(), idx, valid))
    np.testing.assert_array_equal(fn(*a.values(), idx, valid),
                                  _mla.mla_attention_sparse(*a.values(), idx, valid, 0.2, impl="xla"))


def test_the_seam_gives_the_xla_paths_gradient():
    a, idx, valid = inputs(3, 2, 1, 4, 16, 8, 32, 16, 32, 16, 2, 128)
    scale = 0.2

    def loss(impl, q_nope, q_pe, w_uv):
        o = _mla.mla_attention_sparse(q_nope, q_pe, a["c_kv"], a["k_pe"], a["w_uk"], w_uv, idx, valid, scale,
                                      impl=impl, layer=1)
        return jnp.sum(o * o)

    assert "sparse_mla_tpu" in str(jax.make_jaxpr(functools.partial(loss, "interpret_tpu"))(
        a["q_nope"], a["q_pe"], a["w_uv"]))
    grads = {impl: jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2))(a["q_nope"], a["q_pe"], a["w_uv"])
             for impl in ("interpret_tpu", "xla")}
    for got, want in zip(grads["interpret_tpu"], grads["xla"]):
        assert rel(got, want) < 1e-5


def test_tile_schedule_lists_each_touched_tile_once():
    idx = jnp.asarray([[17, 3, 16, 40, 5]], jnp.int32)  # tiles of 8 rows: 2, 0, 2, 5, 0
    code = jnp.asarray([[1, 0, 1, 1, 1]], jnp.int32)
    tiles, n_tiles, row_code = msm.tile_schedule(idx, code, 8, 4)
    assert tiles.tolist() == [[0, 2, 5, 0]] and n_tiles.tolist() == [3]
    want = np.full((4, 8), -1)
    want[0, 3], want[0, 5], want[1, 0], want[1, 1], want[2, 0] = 0, 1, 1, 1, 1
    assert np.array_equal(np.asarray(row_code).reshape(4, 8), want)


def test_cost_estimate_counts_the_blockspecs():
    """8 queries, 96 heads, r 512, p 128, K 2,048 over 4,096 bf16 rows (16-row tiles): at most
    min(2,048, 256) = 256 tiles (8 blocks of 32), 4,096 rows of 640 lanes DMA'd per query."""
    est = msm.cost_estimate(8, 96, 512, 128, 2048, 4096, jnp.bfloat16, 32)
    per_query = 96 * 640 * 2 + 96 * 512 * 4 + 256 * 4 + 4096 * 4 + 4096 * 640 * 2
    assert est.bytes_accessed == 8 * per_query
    assert est.flops == 8 * 4096 * 96 * (2 * 640 + 2 * 512) and est.transcendentals == 8 * 4096 * 96


def test_bad_inputs_name_what_was_expected():
    q = jnp.zeros((2, 8, 128), jnp.float32)
    ckv, kpe = jnp.zeros((1, 2, 64, 128)), jnp.zeros((1, 2, 64, 128))
    idx = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"code has shape \(2, 3\), expected \(2, 4\)"):
        msm.sparse_mla_tpu(q, q, ckv, kpe, idx, jnp.zeros((2, 3), jnp.int32), 0, seq_len=1, scale=1.0)
    with pytest.raises(ValueError, match="S a multiple of 8"):
        msm.sparse_mla_tpu(q, q, ckv[:, :, :60], kpe[:, :, :60], idx, idx, 0, seq_len=1, scale=1.0)


@pytest.mark.parametrize("mesh_spec,per_device", [("expert=4,tensor=2", True), ("tensor=8", False)])
def test_under_a_mesh_equals_one_device(mesh_spec, per_device):
    """expert=4,tensor=2 (rows over `expert`, heads over `tensor`; the caches' sequence and
    latent whole): each device runs the kernel on its slice. tensor=8 (the TP rules split the
    caches' sequence): the XLA path. Both equal the op on one device."""
    from k31jax import sharding

    a, idx, valid = inputs(5, 4, 1, 8, 16, 8, 128, 16, 64, 32, 2, 128)
    want = _mla.mla_attention_sparse(*a.values(), idx, valid, 0.25, impl="xla", layer=1)
    fn = jax.jit(lambda *x: _mla.mla_attention_sparse(*x, 0.25, impl="interpret_tpu", layer=1))
    with sharding.activate(sharding.make_mesh(mesh_spec)):
        text = fn.lower(*a.values(), idx, valid).as_text()
        got = fn(*a.values(), idx, valid)
    assert ("sdy.manual_computation" in text or "shard_map" in text) == per_device
    assert rel(got, want) < 1e-5


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_compiles_for_tpu_reading_the_stack_in_place(topology):
    """libtpu compiles the kernel over 24-layer bf16 stacks (K3.1 widths: 96 heads, r 512,
    k_pe at 128 lanes, top-2,048 of 8,192 rows): no copy of a cache, a few tiles of
    temporaries, and the compile report counts it by its BlockSpec estimate."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())
    n, heads, layers, s, k = 8, 96, 24, 8192, 2048

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    args = (spec((n, 1, heads, 512)), spec((n, 1, heads, 128)), spec((layers, n, s, 512)), spec((layers, n, s, 128)),
            spec((n, 1, k), jnp.int32), spec((n, 1, k), jnp.bool_), spec((), jnp.int32))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(functools.partial(latent_attention_sparse_tpu, scale=0.1)).lower(*args).compile()
    text = compiled.as_text()
    assert "sparse_mla_tpu" in text
    assert not [line for line in text.splitlines() if " copy(" in line and "bf16[24," in line]
    assert compiled.memory_analysis().temp_size_in_bytes < 64 << 20
    est = msm.cost_estimate(n, heads, 512, 128, k, s, jnp.bfloat16, 32)
    report = aot.analyse(text)
    assert est.bytes_accessed <= report.hbm_bytes < 1.2 * est.bytes_accessed
    assert report.hbm_bytes < layers * n * s * 640 * 2 / 4  # far from reading the stacks


def test_model_decodes_through_the_kernel_as_on_xla():
    """tiny with top-16 of 32 cache rows (the sparse kernel's tile rule: the 4 tiles of 8 rows are
    at most 2x the 16 selected): prefill of 21 tokens then 3 decode steps with every layer's
    selection (the indexer's scores) and selected attention on the Mosaic kernels
    (interpret mode, the caches' layer stacks read at the layer), against the XLA paths."""
    from flax import nnx

    from k31jax import K31ForCausalLM, ModelConfig
    from k31jax.ops import Backends

    cfg = ModelConfig.preset("tiny").replace(index_topk=16)
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)

    def run(kernels):
        backends = Backends(kernels=kernels, sparse="gather")  # the kernel's form in prefill too
        step = jax.jit(lambda t, c: model(t, c, backends=backends))
        out = step(tokens[:, :21], model.init_cache(2, 32))
        logits = [out.logits[:, -1]]
        for i in range(21, 24):
            out = step(tokens[:, i:i + 1], out.cache)
            logits.append(out.logits[:, -1])
        jaxpr = str(jax.make_jaxpr(lambda t, c: model(t, c, backends=backends))(tokens[:, :1], out.cache))
        return np.stack(logits, 1), {name for name in ("sparse_mla_tpu", "indexer_scores_tpu") if name in jaxpr}

    (got, kernels_ran), (want, xla_ran) = run("interpret_tpu"), run("xla")
    assert kernels_ran == {"sparse_mla_tpu", "indexer_scores_tpu"} and not xla_ran
    assert rel(got, want) < 1e-4
