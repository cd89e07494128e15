"""Sharded restore of a converted checkpoint: a tiny release-layout folder, converted to
Orbax, read straight onto several meshes (every leaf in its own sharding)."""

import numpy as np
import pytest
from flax import nnx

from k31jax import ModelConfig, distributed, sharding
from k31jax.ckpt import load_checkpoint

from k31jax.ckpt import convert, write_synthetic_release


@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("restore")
    src = write_synthetic_release(work / "release", ModelConfig.preset("tiny", expert_weights="mxfp4"), seed=0)
    convert(src, work / "orbax", progress=False)
    return work / "orbax"


@pytest.mark.parametrize("mesh_spec", ["tensor=8", "expert=4,tensor=2", "fsdp=2,expert=2,tensor=2"])
def test_restore_onto_mesh(orbax_dir, mesh_spec):
    mesh = sharding.make_mesh(mesh_spec)
    model = distributed.load_sharded(orbax_dir, mesh, dtype="float32")
    plain = load_checkpoint(orbax_dir, dtype="float32")
    want = distributed.state_specs(nnx.state(model), mesh)
    for (path, v), (_, w), (_, p) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(want),
                                         nnx.to_flat_state(nnx.state(plain))):
        arr = v.get_value()
        spec = tuple(w.get_value())
        got = tuple(arr.sharding.spec) + (None,) * (arr.ndim - len(arr.sharding.spec))
        assert got == spec + (None,) * (arr.ndim - len(spec)), path
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(p.get_value()), err_msg=str(path))
    packed = model.moe.w_gate.packed[...]
    assert packed.dtype == np.uint8 and len(packed.addressable_shards) == 8
