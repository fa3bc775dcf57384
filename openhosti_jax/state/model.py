"""One model intake: an ``nnx.Module``, a linen module or an ``init_fn(rng)`` as an init function, abstract
parameters and model state, and an apply function.

An nnx module is split into its graph (kept in the apply function), its `nnx.Param` leaves (the parameters) and
the rest (the model state: batch statistics, RNG counts). A linen module is initialised on a sample batch; an
``init_fn`` returning linen variables (``model.init(...)``: ``params`` and other collections such as
``batch_stats``) gives the parameters and, as the model state, the other collections.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from openhosti_jax.state.model import model_parts
    >>> parts = model_parts(lambda r: nnx.Linear(4, 2, rngs=nnx.Rngs(r)))
    >>> [x.shape for x in jax.tree.leaves(parts.params)]
    [(2,), (4, 2)]
    >>> parts.apply_fn(parts.init(jax.random.key(0))[0], jnp.ones((3, 4)), model_state=None).shape
    (3, 2)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import linen, nnx
from jax.sharding import Mesh

from openhosti_jax.errors import StateError
from openhosti_jax.policies.fp8 import fp8_dot_general
from openhosti_jax.policies.precision import Precision, precision
from openhosti_jax.policies.remat import checkpoint
from openhosti_jax.state.blocks import (
    linen_block_paths,
    mark_linen,
    mark_nnx,
    nnx_blocks,
    remat_linen,
    remat_nnx,
    sequence_linen,
    sequence_nnx,
)
from openhosti_jax.state.context import activations_sharded, blocks_marked, current_policies
from openhosti_jax.state.contracts import ApplyFn


def abstract(tree: Any) -> Any:
    """Every array (and Python number) leaf of ``tree`` as a `jax.ShapeDtypeStruct` (shape and dtype only); any
    other leaf (an equinox module's activation function, a string) is kept as it is.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> out = abstract({"w": jnp.ones((2, 3)), "act": jax.nn.relu})
        >>> out["w"], out["act"] is jax.nn.relu
        (ShapeDtypeStruct(shape=(2, 3), dtype=float32), True)
    """

    def leaf(a: Any) -> Any:
        if not isinstance(a, ARRAY_LIKE) and not hasattr(a, "__jax_array__"):
            return a
        return jax.ShapeDtypeStruct(np.shape(a), jax.numpy.result_type(a))

    return jax.tree.map(leaf, tree)


ARRAY_LIKE = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, bool, int, float, complex)
"""The leaves `abstract` describes by shape and dtype."""


def nnx_apply_fn(graphdef: Any) -> ApplyFn:
    """``apply_fn(params, *args, model_state=None, mutable=False, **kw)`` calling the nnx module merged from
    ``graphdef``. With ``mutable=True`` it returns ``(outputs, new_model_state)``: what the call changed (BatchNorm
    statistics in training mode, Dropout's RNG counts), for the step to keep with ``state.replace(model_state=...)``.
    The module is rebuilt with fresh variables on every call, so a call inside ``jax.grad`` may update them.

    Inside a step that sets policies (`openhosti_jax.state.context.active_policies`), the repeated blocks run under
    the remat policy (the whole call when there are none) and every submodule's ``dtype`` is the compute dtype."""

    def apply(params: Any, *args: Any, model_state: Any = None, mutable: bool = False, **kwargs: Any) -> Any:
        policies = current_policies()
        mp = precision(policies.precision if policies else "fp32")
        states = (mp.cast_to_compute(params),) if model_state is None else (mp.cast_to_compute(params), model_state)
        module = nnx.merge(graphdef, *states, copy=True)
        call = module.__call__
        if blocks_marked():
            mark_nnx(module)
        if policies is not None:
            _set_compute_dtype(module, mp)
            if mp.fp8_matmuls:
                _set_fp8_matmuls(module)
            if remat_nnx(module, policies.remat) == 0:
                call = checkpoint(module.__call__, policies.remat)
            if activations_sharded():
                sequence_nnx(module)
            args, kwargs = mp.cast_to_compute((args, kwargs))
        out = mp.cast_output(call(*args, **kwargs))
        return (out, _split(module)[2]) if mutable else out

    return apply


def _set_compute_dtype(module: nnx.Module, mp: Precision) -> None:
    """Give every submodule with a floating ``dtype`` attribute the compute dtype (fp32 leaves them as they are)."""
    if mp.compute_dtype == np.float32:
        return
    for _, sub in nnx.iter_modules(module):
        dtype = getattr(sub, "dtype", None)
        if dtype is None or np.issubdtype(np.dtype(dtype), np.floating):
            object.__setattr__(sub, "dtype", mp.compute_dtype)


def _set_fp8_matmuls(module: nnx.Module) -> None:
    """Give every submodule with a ``dot_general`` (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``) inside
    the repeated blocks (in the whole module where there are none) the fp8 one; the embedding and output head
    outside the blocks stay in the compute dtype, as Transformer Engine and MaxText keep them."""
    roots = [block for _, block in nnx_blocks(module)] or [module]
    for root in roots:
        for _, sub in nnx.iter_modules(root):
            if callable(getattr(sub, "dot_general", None)):
                object.__setattr__(sub, "dot_general", fp8_dot_general)


def policy_apply_fn(apply_fn: ApplyFn, block_paths: set[tuple[str, ...]] | None = None) -> ApplyFn:
    """``apply_fn`` honouring the active policies: parameters and floating inputs cast to the compute dtype, outputs
    to the output dtype, and the remat policy on the linen modules at ``block_paths`` (a linen model) or on the whole
    call (any other function)."""

    def apply(params: Any, *args: Any, **kwargs: Any) -> Any:
        policies = current_policies()
        marked = blocks_marked() and bool(block_paths)
        if policies is None and not marked:
            return apply_fn(params, *args, **kwargs)
        mp = precision(policies.precision if policies else "fp32")
        if mp.fp8_matmuls:
            raise StateError(
                f"precision={mp.name!r} multiplies in fp8 by giving the nnx linear layers of the model's repeated "
                "blocks an fp8 dot_general, but this model is a linen module or a function, whose matmuls the "
                "library cannot reach; use an nnx model, or precision='bf16'"
            )
        remat = policies.remat if policies else "none"
        params, args = mp.cast_to_compute((params, args))
        kwargs = {k: v if k == "model_state" else mp.cast_to_compute(v) for k, v in kwargs.items()}
        with contextlib.ExitStack() as stack:
            call = apply_fn
            if marked:
                stack.enter_context(mark_linen(block_paths))
            if block_paths:
                stack.enter_context(remat_linen(block_paths, remat))
                if activations_sharded():
                    stack.enter_context(sequence_linen(block_paths))
            else:
                call = checkpoint(apply_fn, remat)
            return mp.cast_output(call(params, *args, **kwargs))

    return apply


def _split(module: nnx.Module) -> tuple[Any, Any, Any]:
    return nnx.split(module, nnx.Param, ...)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelParts:
    """A model as the library uses it."""

    init: Callable[[jax.Array], tuple[Any, Any]]
    """``init(rng) -> (params, model_state)``; traceable, so it can run under ``jax.jit`` into shards."""
    params: Any
    """Abstract parameter tree."""
    model_state: Any
    """Abstract non-parameter model variables (nnx), or None."""
    apply_fn: ApplyFn | None
    """The forward pass, when the model defines one (an ``init_fn`` returning a plain tree does not)."""


def _eval_shape(fn: Callable[[jax.Array], Any], key: jax.Array, mesh: Mesh | None) -> Any:
    try:
        if mesh is not None:
            with jax.set_mesh(mesh):  # nnx sharding annotations need a mesh even when only shapes are traced
                return jax.eval_shape(fn, key)
        try:
            return jax.eval_shape(fn, key)
        except ValueError:  # sharding-annotated nnx variables want a mesh: read the annotations without one
            with nnx.use_eager_sharding(False):
                return jax.eval_shape(fn, key)
    except Exception as e:  # noqa: BLE001 - the user's init failed on abstract inputs: say so
        raise StateError(f"init_fn(rng) failed under jax.eval_shape: {e}") from e


def model_parts(
    model: Any, sample_batch: Any | None = None, *, apply_fn: ApplyFn | None = None, mesh: Mesh | None = None
) -> ModelParts:
    """The `ModelParts` of an ``nnx.Module``, a linen module (initialised on ``sample_batch``) or an
    ``init_fn(rng)`` returning an ``nnx.Module`` or a parameter tree. ``apply_fn`` overrides the found one."""
    key = jax.random.key(0)
    if isinstance(model, linen.Module):
        if sample_batch is None:
            raise StateError("a linen module needs a sample batch to initialise; pass sample_batch or an init_fn")
        init = lambda r: _split_variables(model.init(r, sample_batch))
        found = lambda p, *a, model_state=None, **kw: model.apply({"params": p, **(model_state or {})}, *a, **kw)
        params, rest = _eval_shape(init, key, mesh)
        return ModelParts(init, params, rest, policy_apply_fn(apply_fn or found, linen_block_paths(params)))
    if isinstance(model, nnx.Module):
        graphdef, params, rest = _split(model)
        apply = policy_apply_fn(apply_fn) if apply_fn else nnx_apply_fn(graphdef)
        return ModelParts(lambda _: (params, rest), abstract(params), abstract(rest), apply)
    if not callable(model):
        raise StateError(f"expected an nnx.Module, a linen Module or an init_fn(rng), found {type(model).__name__}")
    out = _eval_shape(model, key, mesh)
    if isinstance(out, nnx.Module):
        graphdef, params, rest = _split(out)
        apply = policy_apply_fn(apply_fn) if apply_fn else nnx_apply_fn(graphdef)
        return ModelParts(lambda r: _split(model(r))[1:], params, rest, apply)
    if not jax.tree.leaves(out):
        raise StateError("init_fn(rng) returned no array leaves; expected a params pytree or an nnx.Module")
    if _is_linen_variables(out):  # model.init(...): "params" plus other collections (batch_stats, ...)
        rest = {k: v for k, v in out.items() if k != "params"} or None
        paths = linen_block_paths(out["params"])
        apply = policy_apply_fn(apply_fn, paths) if apply_fn is not None else None
        return ModelParts(lambda r: _split_variables(model(r)), out["params"], rest, apply)
    return ModelParts(lambda r: (model(r), None), out, None, policy_apply_fn(apply_fn) if apply_fn else None)


def _is_linen_variables(tree: Any) -> bool:
    return isinstance(tree, Mapping) and "params" in tree and all(isinstance(v, Mapping) for v in tree.values())


def _split_variables(variables: Mapping) -> tuple[Any, Any]:
    """linen variables as (params, the other collections or None)."""
    return variables["params"], ({k: v for k, v in variables.items() if k != "params"} or None)
