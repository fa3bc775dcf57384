"""The conformance check: a user's step and state trained through ``@spmd`` on 8 simulated devices against the same
step under plain ``jax.jit`` on one device."""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import openhosti_jax as oh

STEPS = 5
TOLERANCE = 1e-4


def on_one_device(tree: Any) -> Any:
    """A fresh copy of ``tree`` on the first device (the reference run donates nothing it does not own)."""
    return jax.device_put(tree, jax.devices()[0])


def losses_of(step: Callable, state: Any, batch: Any, steps: int = STEPS) -> tuple[list[float], Any]:
    """The loss of each of ``steps`` calls of ``step`` on the same batch, and the final state."""
    out = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return out, state


def check_against_one_device(
    make_state: Callable[[], Any], step: Callable, batch: Any, plan: str, **spmd_kw: Any
) -> tuple[Any, Any, Any]:
    """Train ``steps`` on a repeated batch both ways; assert relative loss error <= 1e-4 and a falling loss.

    Returns (reference final state, @spmd final state, the @spmd step)."""
    reference, ref_state = losses_of(jax.jit(step), on_one_device(make_state()), on_one_device(batch))
    sharded = oh.spmd(step, mesh=oh.build_mesh(oh.MeshConfig(data=2, fsdp=4)), plan=plan, **spmd_kw)
    ours, state = losses_of(sharded, make_state(), batch)
    rel = np.abs(np.asarray(ours) - np.asarray(reference)) / np.abs(np.asarray(reference))
    assert rel.max() <= TOLERANCE, (plan, ours, reference)
    assert ours[-1] < ours[0], ours
    return ref_state, state, sharded


def assert_close_trees(a: Any, b: Any, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Every floating leaf of ``a`` equals ``b``'s (the same tree) within the tolerances, every other leaf exactly
    (PRNG keys by their key data)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if np.issubdtype(np.asarray(x).dtype, np.floating):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
