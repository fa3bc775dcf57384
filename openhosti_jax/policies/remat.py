"""Rematerialisation policies, by name: which values of the forward pass the backward pass keeps, and which it
recomputes.

``"none"`` keeps every residual; ``"dots"`` keeps the outputs of matmuls without batch dims (the projections)
and recomputes the rest (attention scores, norms, activations); ``"selective"`` keeps only what the block marks
with `keep` (the bundled models: the attention output and every other projection, torchtitan's selective op
checkpointing) and recomputes the rest; ``"full"`` keeps only each block's inputs and
recomputes the whole block; ``"offload"`` moves the saved matmul outputs to host memory where the backend has a
pinned host memory space (GPU, TPU), and is not available elsewhere.

A policy applies per repeated block (`openhosti_jax.state.model` finds them: lists of identical nnx submodules,
nnx stacks scanned over a ``"layers"`` axis, identical sibling linen submodules), so one block's residuals are
alive at a time during its recompute; a model with no repeated block is checkpointed as a whole.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from openhosti_jax.policies.remat import checkpoint
    >>> f = checkpoint(lambda x: jnp.sin(x) @ x, "full")
    >>> float(jax.grad(lambda x: f(x).sum())(jnp.ones((2, 2)))[0, 0]) == float(
    ...     jax.grad(lambda x: (jnp.sin(x) @ x).sum())(jnp.ones((2, 2)))[0, 0])
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from openhosti_jax.errors import PlanningError

REMAT_POLICIES = ("none", "dots", "selective", "full", "offload")
"""Every policy name, from the most memory kept to the least (``"offload"`` keeps what ``"dots"`` keeps, on the
host)."""

RECOMPUTE_FRACTION = {"none": 0.0, "dots": 0.1, "selective": 0.1, "full": 1.0 / 3.0, "offload": 0.0}
"""Extra FLOPs per step as a fraction of the forward + backward FLOPs (3 x forward): ``"full"`` runs each block's
forward once more (1/3); ``"dots"`` recomputes only the elementwise work and attention between the kept matmuls
(priced at a tenth); ``"selective"`` that and the projections it does not keep (counted from the trace by the
planner); ``"offload"`` recomputes nothing and pays transfers instead."""

KEEP_NAME = "openhosti_keep"
"""The name `keep` gives a value (`jax.ad_checkpoint.checkpoint_name`): what remat ``"selective"`` saves."""


def keep(x: Any) -> Any:
    """``x``, marked as kept for the backward under remat ``"selective"`` (recomputed otherwise); a model calls it
    on the block values worth keeping, e.g. every other projection's output and the attention output.

    >>> import jax.numpy as jnp
    >>> float(keep(jnp.ones(())))
    1.0
    """
    return checkpoint_name(x, KEEP_NAME)


def check_remat(name: str) -> str:
    """``name`` if it is a policy name, else a `PlanningError` listing them."""
    if name not in REMAT_POLICIES:
        raise PlanningError(f"unknown remat policy {name!r}; expected one of {REMAT_POLICIES}")
    return name


def has_host_memory(devices: Sequence[jax.Device]) -> bool:
    """Whether ``devices`` have a pinned host memory space that ``"offload"`` can move residuals to (not CPU:
    its device memory is host memory already)."""
    return bool(devices) and all(
        d.platform != "cpu" and any(m.kind == "pinned_host" for m in d.addressable_memories()) for d in devices
    )


def available_remat(devices: Sequence[jax.Device]) -> tuple[str, ...]:
    """The policies ``devices`` can run."""
    return tuple(p for p in REMAT_POLICIES if p != "offload" or has_host_memory(devices))


def jax_policy(name: str) -> Callable[..., bool] | None:
    """The `jax.checkpoint` policy of ``name`` (None: save nothing but the inputs)."""
    check_remat(name)
    policies = jax.checkpoint_policies
    if name == "dots":
        return policies.dots_with_no_batch_dims_saveable
    if name == "offload":
        return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    if name == "selective":
        return policies.save_only_these_names(KEEP_NAME)
    return policies.nothing_saveable if name == "full" else policies.everything_saveable


def checkpoint(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` under the remat policy ``name`` (unchanged for ``"none"``). Arguments that are not arrays (flags,
    None, strings) are passed through unchanged rather than traced."""
    if check_remat(name) == "none":
        return fn
    policy = jax_policy(name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

        def body(*values: Any) -> Any:
            full = list(leaves)
            for i, v in zip(dynamic, values, strict=True):
                full[i] = v
            a, k = jax.tree.unflatten(tree, full)
            return fn(*a, **k)

        return jax.checkpoint(body, policy=policy)(*(leaves[i] for i in dynamic))

    return wrapped
