"""The one FLOP counter against closed forms: matmuls, scans (per trip), convolutions, and cond (one branch)."""

import jax
import jax.numpy as jnp

from openhosti_jax.flops import count_flops, jaxpr_flops


def test_matmul_scan_and_conv_closed_forms():
    a, b = jnp.ones((2, 8)), jnp.ones((8, 4))
    assert jaxpr_flops(lambda a, b: a @ b, a, b) == 2 * 2 * 8 * 4
    scanned = lambda x, w: jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=3)[0]
    assert jaxpr_flops(scanned, a, jnp.ones((8, 8))) == 3 * 2 * 2 * 8 * 8  # the loop body counted once per trip
    k, x = jnp.ones((3, 3, 4, 8)), jnp.ones((1, 10, 10, 4))
    conv = lambda k, x: jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    assert jaxpr_flops(conv, k, x) == 2 * (8 * 8 * 8) * (3 * 3 * 4)
    assert jaxpr_flops(conv, k, x, matmul_only=True) == 2 * (8 * 8 * 8) * (3 * 3 * 4)


def test_cond_counts_the_costlier_branch_once_and_elementwise_only_when_asked():
    x = jnp.ones((4, 4))
    both = lambda p, x: jax.lax.cond(p, lambda y: y @ y @ y, lambda y: y @ y, x)
    assert jaxpr_flops(both, True, x, matmul_only=True) == 2 * (2 * 4 * 4 * 4)  # two matmuls, not three
    tanh = lambda x: jnp.tanh(x @ x)
    closed = jax.make_jaxpr(tanh)(x)
    assert count_flops(closed, matmul_only=True) == 2 * 4 * 4 * 4
    assert count_flops(closed) == 2 * 4 * 4 * 4 + 16  # + one per output element of tanh


def test_planner_workload_counts_with_the_same_counter():
    from flax import nnx

    from openhosti_jax.planner.workload import workload

    class Pick(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((8, 8)))

        def __call__(self, x):
            return jax.lax.cond(x.sum() > 0, lambda y: y @ self.w @ self.w, lambda y: y @ self.w, x)

    w = workload(Pick(), jax.ShapeDtypeStruct((2, 8), jnp.float32))
    assert w.flops_per_example == 3 * 2 * (2 * 8 * 8)  # forward + backward of the costlier branch, per example
