"""Logical-axis rules, Flax metadata reading and tensor-parallel specs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from openhosti_jax.sharding.rules import DEFAULT_RULES, logical_names, logical_spec
from openhosti_jax.sharding.tensor import base_specs


def test_first_free_axis_wins_and_indivisible_dims_stay_unsharded():
    rules = [("a", "tensor"), ("a", "fsdp"), ("b", "tensor"), ("b", "data")]
    assert logical_spec(("a", "b"), (8, 8), {"tensor": 2, "fsdp": 2, "data": 2}, rules) == P("tensor", "data")
    assert logical_spec(("a", "b"), (7, 8), {"tensor": 2, "fsdp": 2, "data": 2}, rules) == P(None, "tensor")


def test_reads_nnx_and_linen_metadata():
    class M(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.l = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)

    with nnx.use_eager_sharding(False):
        m = nnx.eval_shape(lambda: M(nnx.Rngs(0)))
    _, params, _ = nnx.split(m, nnx.Param, ...)
    assert logical_names(params) == [None, ("embed", "mlp")]  # bias, kernel

    class L(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)

    boxed = jax.eval_shape(lambda r: L().init(r, jnp.ones((1, 8)))["params"], jax.random.key(0))
    assert logical_names(boxed) == [None, ("embed", "mlp")]
    assert base_specs(boxed, {"tensor": 4}, DEFAULT_RULES)[1] == P(None, "tensor")


def test_tensor_parallel_column_then_row():
    params = {
        "fc": {
            "kernel": jax.ShapeDtypeStruct((64, 256), jnp.float32),
            "bias": jax.ShapeDtypeStruct((256,), jnp.float32),
        },
        "out": {
            "kernel": jax.ShapeDtypeStruct((256, 64), jnp.float32),
            "bias": jax.ShapeDtypeStruct((64,), jnp.float32),
        },
    }
    specs = base_specs(params, {"tensor": 4})  # leaves in key order: fc.bias, fc.kernel, out.bias, out.kernel
    assert specs == [P("tensor"), P(None, "tensor"), P(None), P("tensor", None)]
    assert base_specs(params, {"tensor": 1}) == [P(None), P(None, None), P(None), P(None, None)]
