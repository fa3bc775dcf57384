"""The one FLOP counter against closed forms: matmuls, scans (per trip), convolutions, and cond (one branch); the one
rule for nested calls (`openhosti_jax.jaxpr_walk`) that it and the planner's walkers follow."""

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


def test_one_rule_for_nested_calls():
    """`calls` is the one rule every walker follows: a scan's body per trip (its xs sliced, its ys stacked), the
    costliest cond branch once, a while's predicate and body once each, any other call once, operands aligned."""
    from openhosti_jax.flops import matmul_flops
    from openhosti_jax.jaxpr_walk import calls, is_remat

    x = jnp.ones((4, 4))

    @jax.custom_vjp
    def cv(y):
        return jnp.sin(y)

    cv.defvjp(lambda y: (cv(y), y), lambda r, g: (g * r,))
    f = lambda x: (
        jax.lax.scan(lambda c, a: (c @ x, c * a), x[0], x),
        jax.lax.cond(x.sum() > 0, lambda y: y @ y @ y, lambda y: y @ y, x),
        jax.lax.while_loop(lambda c: c.sum() < x.sum(), lambda c: c @ x, x),
        jax.checkpoint(jnp.sin)(x),
        jax.jit(jnp.cos)(x),
        cv(x),
    )
    jaxpr = jax.make_jaxpr(f)(x).jaxpr
    found = {e.primitive.name: (e, calls(e, matmul_flops)) for e in jaxpr.eqns if calls(e, matmul_flops)}
    eqn, (body,) = found["scan"]
    assert (body.trips, body.operands, body.results) == (4, tuple(eqn.invars), tuple(eqn.outvars))
    assert (body.sliced, body.stacked) == (2, 1)  # x (a const) and the carry whole, then the xs; the carry, the ys
    eqn, (branch,) = found["cond"]
    assert matmul_flops(branch.jaxpr) == 2 * (2 * 4**3) and branch.operands == tuple(eqn.invars[1:])
    eqn, (pred, loop) = found["while"]
    assert pred.results is None and loop.results == tuple(eqn.outvars) and (pred.trips, loop.trips) == (1, 1)
    for name in ("jit", "custom_vjp_call"):
        eqn, (call,) = found[name]
        assert (call.trips, call.operands, call.results) == (1, tuple(eqn.invars), tuple(eqn.outvars))
    assert [is_remat(e) for e, _ in found.values()] == [False, False, False, True, False, False]


def test_walkers_take_the_same_cond_branch():
    """The FLOP counter, remat block counting and sharding propagation all price the branch with the most matmul
    FLOPs, even where another branch holds more checkpointed calls."""
    from openhosti_jax.planner.propagate import propagate
    from openhosti_jax.planner.workload import remat_blocks

    block = jax.checkpoint(lambda y: jnp.tanh(y @ y))
    x = jnp.ones((4, 4))
    # the true branch: one block and three more matmuls (4 matmuls); the false branch: two blocks (2 matmuls)
    f = lambda x: jax.lax.cond(x.sum() > 0, lambda y: block(y) @ y @ y @ y, lambda y: block(block(y)), x)
    jaxpr = jax.make_jaxpr(f)(x).jaxpr
    assert count_flops(jaxpr, matmul_only=True) == 4 * (2 * 4**3)
    assert remat_blocks(jaxpr) == 1  # the priced branch's one block (summing the branches said 3)
    assert propagate(jaxpr, [1], 2).split_flops == 4 * (2 * 4**3)  # the split reaches into the branch
