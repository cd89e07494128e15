"""The Pallas TPU (Mosaic) lightning-indexer masked scores: in TPU interpret mode on CPU against
a float64 NumPy reference written from the formula (architecture.md §10) and the XLA op plus
the causal / validity mask, its cost estimate against a derivation by hand, and compiled by
libtpu for v5e / v5p / v6e / tpu7x (skipped with the reason without it).

Awkward cases: S not a multiple of the key block (300 keys in blocks of 128: the last block
partly past the end of k), HI = 5 (padded to 8 heads), dI = 24 (not a multiple of 128), a batch
of 1, several query rows per batch row at different positions (one at position 0: one
candidate; one whose later key blocks are skipped; one past the last key), invalid keys, bf16
keys.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax import aot
from k31jax.kernels.sparse_mla import mosaic_indexer as mi
from k31jax.ops import _indexer

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu not installed (pip install 'k31jax[tpu]')")


def inputs(seed, b, t, hi, di, s, k_dtype, positions):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b * t, hi, di)).astype(np.float32)
    w = rng.standard_normal((b * t, hi)).astype(np.float32)
    k = jnp.asarray(rng.standard_normal((b, s, di)), k_dtype)
    q_pos = np.asarray(positions, np.int32)
    key_valid = rng.random((b, s)) > 0.25
    key_valid[:, 0] = True  # the query at position 0 has its one candidate
    return q, w, k, q_pos, key_valid


def f64_ref(q, w, k, q_pos, key_valid):
    """`dI^-½ Σ_j w[n,j] ReLU(q[n,j]·k[b,s])`, −inf where s > q_pos[n] or key s is invalid."""
    k = np.asarray(jnp.asarray(k, jnp.float32), np.float64)
    b, s, di = k.shape
    t = q.shape[0] // b
    out = np.empty((q.shape[0], s))
    for n in range(q.shape[0]):
        dots = np.asarray(q[n], np.float64) @ k[n // t].T                      # [HI, S]
        out[n] = np.asarray(w[n], np.float64) @ np.maximum(dots, 0.0) * di ** -0.5
        out[n][(np.arange(s) > q_pos[n]) | ~key_valid[n // t]] = -np.inf
    return out


def xla_ref(q, w, k, q_pos, key_valid):
    """The XLA op `_indexer.indexer_scores` on `[B, T, ...]` and the same mask, as `[N, S]`."""
    b, s, di = k.shape
    t = q.shape[0] // b
    sc = _indexer.indexer_scores(jnp.asarray(q).reshape(b, t, -1, di), jnp.asarray(w).reshape(b, t, -1), k)
    ok = (np.arange(s)[None, None, :] <= q_pos.reshape(b, t)[:, :, None]) & key_valid[:, None, :]
    return np.where(ok, np.asarray(sc, np.float64), -np.inf).reshape(b * t, s)


def check(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)          # the −inf pattern, exactly
    assert np.all(got[~finite] == -np.inf)
    err = np.max(np.abs(got[finite] - want[finite])) / np.max(np.abs(want[finite]))
    assert err < tol, err


def run(q, w, k, q_pos, key_valid, block_s):
    return jax.jit(lambda *a: mi.indexer_scores_tpu(*a, block_s=block_s, interpret=True))(q, w, k, q_pos, key_valid)


@pytest.mark.parametrize("b,t,hi,di,s,k_dtype,positions,block_s", [
    # a batch of 1, bf16 keys: row 0 at position 0 (one candidate; key blocks 1-2 skipped), row 1
    # at 150 (block 2 skipped), row 2 sees all 300 keys (the last block partly past the end of k)
    (1, 3, 5, 24, 300, jnp.bfloat16, [0, 150, 299], 128),
    # two batch rows of two rows each, fp32 keys, aligned widths; a row past the last key
    (2, 2, 8, 128, 256, jnp.float32, [3, 200, 255, 1000], 128),
])
def test_matches_float64_and_the_xla_op(b, t, hi, di, s, k_dtype, positions, block_s):
    q, w, k, q_pos, key_valid = inputs(b * 10 + t, b, t, hi, di, s, k_dtype, positions)
    got = run(q, w, k, q_pos, key_valid, block_s)
    assert got.dtype == jnp.float32 and got.shape == (b * t, s)
    got = np.asarray(got)
    if positions[0] == 0:  # one candidate: key 0
        assert np.flatnonzero(np.isfinite(got[0])).tolist() == [0]
    check(got, f64_ref(q, w, k, q_pos, key_valid), 1e-5)
    check(got, xla_ref(q, w, k, q_pos, key_valid), 1e-5)
    # the keys as row 1 of a 3-layer stack (the model's caches), read there in place
    stack = jnp.stack([jnp.full_like(k, jnp.nan), k, -k])
    in_stack = jax.jit(lambda *a: mi.indexer_scores_tpu(*a[:5], layer=a[5], block_s=block_s, interpret=True))(
        q, w, stack, q_pos, key_valid, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(in_stack), got)


def test_padded_heads_add_nothing_and_topk_matches_the_xla_selection():
    """HI = 5 is padded to 8 heads with w = 0: three extra heads with random q and w = 0 give the
    very same scores. `lax.top_k` on the kernel's scores selects the XLA `select_topk`'s keys."""
    b, t, hi, di, s = 1, 3, 5, 24, 300
    q, w, k, q_pos, key_valid = inputs(7, b, t, hi, di, s, jnp.bfloat16, [0, 150, 299])
    got = np.asarray(run(q, w, k, q_pos, key_valid, 128))
    rng = np.random.default_rng(8)
    q8 = np.concatenate([q, rng.standard_normal((b * t, 3, di)).astype(np.float32)], axis=1)
    w8 = np.concatenate([w, np.zeros((b * t, 3), np.float32)], axis=1)
    np.testing.assert_array_equal(np.asarray(run(q8, w8, k, q_pos, key_valid, 128)), got)

    top_k = 16
    vals, idx = jax.lax.top_k(jnp.asarray(got).reshape(b, t, s), top_k)
    idx_x, valid_x = _indexer.select_topk(jnp.asarray(q).reshape(b, t, hi, di), jnp.asarray(w).reshape(b, t, hi), k,
                                          jnp.asarray(q_pos), jnp.asarray(key_valid), top_k, impl="xla")
    valid = np.asarray(vals > -jnp.inf)
    np.testing.assert_array_equal(valid, np.asarray(valid_x))
    assert valid[0, 0].sum() == 1 and valid[0, 2].all()
    for row in range(t):
        assert sorted(np.asarray(idx)[0, row][valid[0, row]]) == sorted(np.asarray(idx_x)[0, row][valid[0, row]])


def test_cost_estimate_counts_each_block_once():
    """N = 2 rows, HI = 8, dI = 128, S = 1024 in key blocks of 512, bf16 k: a grid of 2 x 2 = 4
    steps. Per row, once: q 8·128·4 = 4096 B, w 8·4 = 32 B, its int32 position 4 B. Per step:
    the k block 512·128·2 = 131072 B, the int32 validity row 512·4 = 2048 B, the fp32 score row
    512·4 = 2048 B. Flops per step: 2·8·128·512 (matmul) + 3·8·512 (ReLU, weight, head sum) +
    512 (scale)."""
    est = mi.cost_estimate(n=2, hi=8, di=128, s_pad=1024, block_s=512, k_itemsize=2)
    assert est.bytes_accessed == 2 * (4096 + 32 + 4) + 4 * (131072 + 2048 + 2048) == 548936
    assert est.flops == 4 * (2 * 8 * 128 * 512 + 3 * 8 * 512 + 512) == 4245504
    assert est.transcendentals == 0


def test_bad_inputs_are_one_clear_error():
    q, w, k, q_pos, key_valid = inputs(3, 1, 3, 5, 24, 300, jnp.float32, [0, 1, 2])
    with pytest.raises(ValueError, match=r"k has shape \(1, 300, 16\), expected \(1, 300, 24\)"):
        mi.indexer_scores_tpu(q, w, k[..., :16], q_pos, key_valid, interpret=True)
    with pytest.raises(ValueError, match=r"key_valid has shape \(1, 299\), expected \(1, 300\)"):
        mi.indexer_scores_tpu(q, w, k, q_pos, key_valid[:, :299], interpret=True)
    with pytest.raises(ValueError, match=r"w has shape \(3, 4\), expected \(3, 5\)"):
        mi.indexer_scores_tpu(q, w[:, :4], k, q_pos, key_valid, interpret=True)
    with pytest.raises(ValueError, match="q has 3 rows, expected a multiple of k's batch 2"):
        mi.indexer_scores_tpu(q, w, jnp.concatenate([k, k]), q_pos, np.concatenate([key_valid] * 2), interpret=True)
    with pytest.raises(ValueError, match="block_s=100, expected a positive multiple of 128"):
        mi.indexer_scores_tpu(q, w, k, q_pos, key_valid, block_s=100, interpret=True)


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_compiles_for_tpu_reading_the_keys_in_place(topology):
    """libtpu compiles the launch at a decode shape (2 batch rows x 4 queries of 64 heads x 128
    against 4,000 bf16 keys: not a multiple of the 512-key block), the keys a 64-layer stack (larger than VMEM) read
    at a row: the kernel is in the program; the stack reaches it as it is (no pad or relayout of the key cache: at most XLA's own prefetch of it
    into VMEM, a copy-start); the temporaries are at most the score rows and their relayout
    (never an [N, HI, S] intermediate); and the compile report counts the kernel by its BlockSpec
    cost estimate (plus the small ops around it: the validity widening, the scores' relayout)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())
    b, n, hi, di, s, s_pad = 2, 8, 64, 128, 4000, 4096

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    specs = (spec((n, hi, di), jnp.float32), spec((n, hi), jnp.float32), spec((64, b, s, di), jnp.bfloat16),
             spec((n,), jnp.int32), spec((b, s), jnp.bool_), spec((), jnp.int32))
    # the Mosaic lowering reads the TPU generation from the (abstract) mesh, not from this CPU host
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(lambda *a: mi.indexer_scores_tpu(*a[:5], layer=a[5])).lower(*specs).compile()
    text = compiled.as_text()
    assert "indexer_scores_tpu" in text
    entry = text[text.index("\nENTRY"):].splitlines()
    k_param = next(line.split(" = ")[0].strip() for line in entry if "bf16[64,2,4000,128]" in line and "parameter(" in line)
    k_users = [re.search(r" ([\w-]+)\(%", line).group(1) for line in entry
               if f"{k_param})" in line or f"{k_param}," in line]
    assert k_users and set(k_users) <= {"custom-call", "copy-start"}, k_users
    assert compiled.memory_analysis().temp_size_in_bytes <= 2 * n * s_pad * 4
    est = mi.cost_estimate(n, hi, di, s_pad, 512, 2)
    report = aot.analyse(text)
    assert report.flops >= est.flops
    assert est.bytes_accessed <= report.hbm_bytes < 1.5 * est.bytes_accessed


@pytest.mark.parametrize("mesh_spec", [None, "expert=4,tensor=2"])
def test_select_topk_through_the_seam_reads_the_stack_at_the_layer(mesh_spec):
    """`ops.select_topk(impl="interpret_tpu", layer=)` on a bf16 key stack equals the XLA path
    (same slots, same validity); under expert=4,tensor=2 each device runs its rows (the keys'
    sequence stays whole under those rules)."""
    import contextlib

    from k31jax import sharding

    rng = np.random.default_rng(7)
    b, t, hi, di, s, top = 4, 1, 4, 32, 200, 16
    q = jnp.asarray(rng.standard_normal((b, t, hi, di)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, t, hi)), jnp.float32)
    stack = jnp.asarray(rng.standard_normal((3, b, s, di)), jnp.bfloat16)
    q_pos = jnp.asarray([150], jnp.int32)
    key_valid = jnp.asarray(rng.random((b, s)) > 0.2)

    def run(impl):
        return jax.jit(lambda *a: _indexer.select_topk(*a[:5], top, impl=impl, layer=a[5]))(
            q, w, stack, q_pos, key_valid, jnp.int32(2))

    want = run("xla")
    with sharding.activate(sharding.make_mesh(mesh_spec)) if mesh_spec else contextlib.nullcontext():
        got = run("interpret_tpu")
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    for row in range(b):
        ok = np.asarray(want[1])[row, 0]
        assert sorted(np.asarray(got[0])[row, 0][ok]) == sorted(np.asarray(want[0])[row, 0][ok])


def test_several_queries_per_row_keep_the_xla_path():
    """A verify step's 3 queries per row: the kernel would read the row's keys once per query,
    so `select_topk` keeps the XLA path there (no kernel in the program); the same selection."""
    rng = np.random.default_rng(8)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    stack = jnp.asarray(rng.standard_normal((2, 2, 64, 32)), jnp.bfloat16)
    args = (q, w, stack, jnp.asarray([40, 41, 42], jnp.int32), jnp.ones((2, 64), bool), jnp.int32(1))

    def fn(impl):
        return lambda *a: _indexer.select_topk(*a[:5], 8, impl=impl, layer=a[5])

    assert "indexer_scores_tpu" not in str(jax.make_jaxpr(fn("interpret_tpu"))(*args))
    one = (q[:, :1], w[:, :1], stack, args[3][:1], *args[4:])
    assert "indexer_scores_tpu" in str(jax.make_jaxpr(fn("interpret_tpu"))(*one))
    for got, want in zip(fn("interpret_tpu")(*args), fn("xla")(*args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
