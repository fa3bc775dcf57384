"""``@spmd`` on a step of any signature ``jax.jit`` or ``nnx.jit`` takes, changed only at the decorator line.

Flax's NNX tutorial step mutates its graph objects and returns nothing (or the loss)::

    @oh.spmd(mesh=mesh, plan="fsdp")
    def train_step(model, optimizer, metrics, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        metrics.update(loss=loss)
        optimizer.update(model, grads)

optax's quick start spreads the state over several arguments and returns it: ``step(params, opt_state, batch) ->
(params, opt_state, loss)``. Keys, Python step counters and static flags (``static_argnums`` / ``static_argnames``)
may follow. Each call is split by `openhosti_jax.state.call.bind`: the arguments holding the parameters, the
optimizer state or a graph object are the state, found once (nnx ``Param`` variables, or the optimizer's mirror;
``spmd(params=..., opt_state=...)`` names them by argument position) and placed by the plan; the data's batch
leaves are split over the data axes. The step is traced once per argument structure and static values
(`openhosti_jax.state.outputs.canonical_step`); after each call the caller's graph objects hold their new state (in
place) and the return value is the step's, with the updated state arguments in it. The state is donated when the
step gives all of it back (graph objects always do; a pytree argument must be returned).

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import openhosti_jax as oh
    >>> tx = optax.adam(0.1)
    >>> @oh.spmd(mesh=oh.build_mesh(oh.MeshConfig(data=-1)), plan="dp")
    ... def step(params, opt_state, x):
    ...     loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
    ...     updates, opt_state = tx.update(g, opt_state, params)
    ...     return optax.apply_updates(params, updates), opt_state, loss
    >>> params = {"w": jnp.ones((4, 1))}
    >>> params, opt_state, loss = step(params, tx.init(params), jnp.ones((8, 4)))
    >>> float(loss), step.layout.describe(oh.state.call.arg_path)
    (16.0, 'parameters at args[0], optimizer state at args[1]')
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import PartitionSpec as P

from openhosti_jax.errors import StateError, StepOutputError
from openhosti_jax.sharding.batch import batch_leaves, place_batch
from openhosti_jax.state.call import LEAF_TYPES, StepCall, arg_path, bind, call_layout, is_graph_object
from openhosti_jax.state.jit import jit_step
from openhosti_jax.state.kinds import is_kind_object
from openhosti_jax.state.layout import StateLayout
from openhosti_jax.state.outputs import Recipe, canonical_step, restore, unreturned
from openhosti_jax.train.compile_cache import caching_steps

if TYPE_CHECKING:
    from openhosti_jax.train.spmd_step import SpmdStep


@dataclasses.dataclass(frozen=True)
class _Compiled:
    fn: Any
    state_shardings: Any
    recipe: Recipe
    flags: tuple[bool, ...]


def _placed(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s), tree, shardings
    )


def _rebased(layout: StateLayout, key: str) -> StateLayout:
    """``layout`` of a state that is now the view's argument ``key``."""
    head = (jax.tree_util.DictKey(key),)
    opt = None if layout.opt_path is None else head + layout.opt_path
    return dataclasses.replace(layout, params_path=head + layout.params_path, opt_path=opt)


class AnyCalls:
    """The calls of one `SpmdStep` that are not ``(state, batch) -> (state, metrics)``: their state keys, and a
    compiled step per argument structure."""

    def __init__(self, owner: SpmdStep) -> None:
        self.owner = owner
        self.active = False
        """Whether every call now runs here (after the first such call, or a fall-back)."""
        self.ran_pairs = False
        """Whether a ``(state, batch)`` call already ran as one."""
        self.keys: tuple[str, ...] | None = None
        self._compiled: dict[Any, _Compiled] = {}
        self._pending: StepOutputError | None = None

    def is_state_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the call is ``step(state, batch)`` of two pytrees, nothing static: the library's own form."""
        if len(args) != 2 or kwargs or any(self.owner._static):
            return False
        other = lambda x: is_graph_object(x) or is_kind_object(x)  # noqa: E731 - nnx objects, equinox modules
        plain = lambda x: x is None or isinstance(x, LEAF_TYPES)  # noqa: E731 - else bind names what it is
        return all(plain(x) and not other(x) for x in jax.tree.leaves(args, is_leaf=other))

    def fall_back(self, args: tuple[Any, ...], err: StepOutputError) -> Any:
        """Run a ``step(state, batch)`` that returned something else than ``(state, metrics)`` (flax's ``return
        state``) as a step of any signature, if it returns its state; else raise ``err``."""
        self.active, self.keys, self._pending = True, ("0",), err
        self.owner.layout = _rebased(self.owner.layout, "0")
        self.owner._where = arg_path
        return self(args, {})

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        step = self.owner
        call = bind(args, kwargs, step._static)
        if self.keys is None:
            step.layout, self.keys = call_layout(call, **step._paths)
            step._where = arg_path
        self.active = True
        state = {k: call.view[k] for k in self.keys}
        data = {k: v for k, v in call.view.items() if k not in self.keys}
        if step.plan is None or step.report is None:
            planned, _ = canonical_step(step.fn, call, self.keys)
            step._plan_fn = lambda s, d: (planned(s, d)[0], {})
        step._resolve(state, data)
        self._set_microbatches()
        compiled = self._compile(call, state, data)
        state = _placed(state, compiled.state_shardings)
        data = self._place_data(data, compiled.flags)
        with jax.set_mesh(step.mesh), caching_steps():
            new, out = compiled.fn(state, data)
        call.update_graph(new)
        step.skipped_nonfinite = out.get("skipped_nonfinite")
        return restore(compiled.recipe, new, out["outputs"], call)

    def _set_microbatches(self) -> None:
        step = self.owner
        if step._microbatch == "auto":
            raise StateError(
                "microbatch='auto' searches microbatch sizes of a step(state, batch) built with make_train_step, "
                f"found a step of another signature ({getattr(step.fn, '__name__', step.fn)}); give microbatch an "
                "accumulation count the step reads with openhosti_jax.state.context.current_microbatches(), or drop it"
            )
        if step._microbatch and step.plan.num_microbatches != step._microbatch:
            step.plan = dataclasses.replace(step.plan, num_microbatches=step._microbatch)

    def _compile(self, call: StepCall, state: dict, data: dict) -> _Compiled:
        step = self.owner
        flags = tuple(batch_leaves(data))
        key = (call.key(), flags, step.plan.num_microbatches)
        if key in self._compiled:
            return self._compiled[key]
        fn, recipe = canonical_step(step.fn, call, self.keys)
        donate = step.donate
        if any(k not in call.graph_keys() for k in self.keys):  # which pytree state arguments come back?
            jax.eval_shape(fn, state, data)
            kept = unreturned(recipe, call, self.keys)
            if self._pending is not None and kept:
                raise self._pending
            if kept and donate:
                donate = False
                step.report.record(
                    f"state not donated: the step does not return {', '.join(kept)} (return it updated to donate "
                    "the state, or pass spmd(..., donate=False) to say so)"
                )
        self._pending = None
        data_sh = step.plan.batch_shardings(step.mesh, data)
        jitted, state_sh = jit_step(
            fn,
            step.plan,
            step.mesh,
            state,
            data,
            donate=donate,
            layout=step.layout,
            skip_nonfinite=step.skip_nonfinite,
            batch_shardings=data_sh,
            free_outputs=True,
            compiler_options=step.compiler_options(state),
        )
        self._compiled[key] = _Compiled(jitted, state_sh, recipe, flags)
        return self._compiled[key]

    def _place_data(self, data: dict, flags: tuple[bool, ...]) -> dict:
        """The data with its batch leaves split over the plan's data axes and every other leaf replicated."""
        mesh, spec = self.owner.mesh, self.owner.plan.batch_spec
        leaves, treedef = jax.tree.flatten(data)
        split = place_batch(
            treedef.unflatten([x if f else None for x, f in zip(leaves, flags, strict=True)]), mesh, spec
        )
        rest = place_batch(treedef.unflatten([None if f else x for x, f in zip(leaves, flags, strict=True)]), mesh, P())
        split_it, rest_it = iter(jax.tree.leaves(split)), iter(jax.tree.leaves(rest))
        return treedef.unflatten([next(split_it) if f else next(rest_it) for f in flags])
