"""place_batch, the one batch placer: any pytree, per-leaf global shapes checked with their paths, device arrays
resharded only when needed, values unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import BatchError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.sharding import place_batch


def test_any_pytree_is_placed_on_the_data_axes_with_values_unchanged():
    mesh = build_mesh(MeshConfig(data=2, fsdp=4))
    x, y = np.arange(48.0, dtype=np.float32).reshape(16, 3), np.arange(16, dtype=np.int64)
    placed = place_batch((x, {"y": y, "scale": np.float32(0.5)}), mesh)
    gx, inner = placed
    assert gx.sharding.spec == P(("data", "fsdp")) and inner["scale"].sharding.spec == P()
    assert inner["y"].dtype == jnp.int32  # narrowed as JAX holds it (x64 off), range-checked
    np.testing.assert_array_equal(np.asarray(gx), x)
    np.testing.assert_array_equal(np.asarray(inner["y"]), y)
    for shard in gx.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])


def test_device_arrays_are_resharded_once_and_left_alone_after():
    mesh = build_mesh(MeshConfig(data=8))
    on_one = jax.device_put(jnp.arange(8.0), jax.devices()[0])
    placed = place_batch({"x": on_one}, mesh)
    assert placed["x"].sharding.spec == P(("data", "fsdp")) and len(placed["x"].addressable_shards) == 8
    assert place_batch(placed, mesh)["x"] is placed["x"]


def test_every_bad_leaf_is_named_with_its_path_and_the_fix():
    mesh = build_mesh(MeshConfig(data=8))
    with pytest.raises(BatchError) as err:
        place_batch({"a": np.zeros((12, 2)), "b": [np.zeros(8), np.zeros(6)]}, mesh)
    msg = str(err.value)
    assert "batch['a']: dim 0 of global size 12" in msg and "batch['b'][1]: dim 0 of global size 6" in msg
    assert "batch['b'][0]" not in msg and "multiple of 8" in msg
    with pytest.raises(BatchError, match="spec per key needs a dict batch"):
        place_batch((np.zeros(8),), mesh, {"x": P("data")})
