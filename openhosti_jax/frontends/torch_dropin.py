"""OptimizedDDP's drop-in call: ``model(*args, **kwargs)`` as one JAX program over the mesh's data axis.

Every tensor argument whose dim 0 is the batch's (the first tensor's dim 0) is split over the data axis; other
tensors are replicated; non-tensor arguments select the compiled program. A batch that does not divide by the
devices (a DataLoader's short last batch) is placed whole and split unevenly inside the program (XLA pads the last
device's share and leaves the padding out of every reduction), so means, losses and BatchNorm statistics are those
of the real rows. The output keeps its structure (tensor, tuple, dict, dataclass, ``ModelOutput``); each process gets
its own rows of the batch-sized tensors and the whole of the others. JAX computes without 64-bit types by default:
integer outputs come back as torch's int64, float64 arguments are computed in float32.

With gradients enabled the program is ``jax.vjp`` of the forward: it returns the output and the VJP's residuals, which
stay on the devices until ``backward()`` runs them (the forward is not run again); the parameters' gradients land in
``param.grad`` (averaged over processes, as DDP's all-reduce leaves them), and those of float inputs that require grad
in theirs. Under ``torch.no_grad()`` (or with no parameter requiring grad) the program is the forward alone.
`uneven_train_step` is the full mode's step for such a short batch.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import torch
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.bridges.tensors import to_jax, to_torch, torch_to_numpy
from openhosti_jax.bridges.torch_lowering import Lowered
from openhosti_jax.bridges.torch_tree import flatten, static_key, unflatten
from openhosti_jax.errors import UnsupportedError


class _Static:
    """A trace-time value carried out of a jitted function as pytree structure (compared by identity)."""

    def __init__(self, value: Any) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s), lambda s, _: s)


def host_value(x: jax.Array) -> np.ndarray:
    """``x``'s whole value on this process (a writable copy; an explicit transfer, as `jax.transfer_guard` asks)."""
    if x.is_fully_replicated:
        return np.array(jax.device_get(x.addressable_data(0)))
    if x.is_fully_addressable:
        return np.array(jax.device_get(x))
    return np.array(multihost_utils.process_allgather(x, tiled=True))


def put_value(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The same host ``value`` on every process, placed as ``sharding`` (explicitly: `jax.device_put` on one
    process)."""
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _shares_memory(t: torch.Tensor) -> bool:
    """Whether JAX's devices are where ``t`` lives (CPU with CPU, CUDA with GPU): DLPack then moves nothing."""
    platform = jax.devices()[0].platform
    return (t.device.type == "cpu" and platform == "cpu") or (t.device.type == "cuda" and platform in ("gpu", "cuda"))


def device_value(t: torch.Tensor, sharding: NamedSharding) -> jax.Array:
    """``t`` (this process's whole value) placed as ``sharding`` without a trip through the host where JAX and
    torch share the device kind: a zero-copy DLPack view on the tensor's own device, then device-to-device
    copies. Otherwise (a CPU tensor for GPU devices) through host memory, as it must."""
    if _shares_memory(t):
        return jax.device_put(to_jax(t), sharding)
    return jax.device_put(torch_to_numpy(t), sharding)


@functools.cache
def _replicator(mesh: Mesh) -> Any:
    """A program that replicates an array over ``mesh``'s devices."""
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))


def device_tensor(x: jax.Array, device: torch.device) -> torch.Tensor:
    """``x``'s whole value as a torch tensor on ``device``: a DLPack view of its first shard (a replicated array) or
    of a device-to-device gather; JAX's 32-bit integers widened to torch's int64 (JAX has no 64-bit ones by
    default). Only where the devices differ in kind is it copied through the host."""
    if not x.is_fully_replicated and isinstance(x.sharding, NamedSharding):
        x = _replicator(x.sharding.mesh)(x)  # an all-gather among the devices (a host gather on CPU otherwise)
    t = to_torch(x)
    if t.dtype == torch.int32:
        t = t.to(torch.int64)
    return t if t.device == device else t.to(device)


def _to_torch(value: np.ndarray) -> torch.Tensor:
    """A host value as torch gives it: JAX's 32-bit integers (it has no 64-bit ones by default) as torch's int64."""
    if value.dtype.name == "bfloat16":  # numpy has no bfloat16 of its own: through float32
        return torch.from_numpy(value.astype(np.float32)).to(torch.bfloat16)
    if value.dtype == np.int32:
        return torch.from_numpy(value.astype(np.int64))
    return torch.from_numpy(np.array(value))


class _Call:
    """One call's layout: which tensors are batch rows, whether the batch divides the devices, what is
    differentiated."""

    def __init__(self, engine: DropIn, leaves: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        self.nproc, self.pid = engine.nproc, (jax.process_index() if engine.nproc > 1 else 0)
        self.local = next((t.shape[0] for t in leaves if t.ndim), None)  # this process's batch size
        self.rows = tuple(bool(t.ndim) and t.shape[0] == self.local for t in leaves)
        self.batch = None if self.local is None else self.local * self.nproc
        self.even = self.local is None or self.local % (engine.devices // self.nproc) == 0
        grad = torch.is_grad_enabled()
        self.diff_params = tuple(grad and p.requires_grad for p in params)
        self.diff_inputs = tuple(grad and t.requires_grad and t.is_floating_point() for t in leaves)
        self.needs_grad = any(self.diff_params) or any(self.diff_inputs)
        first = next(iter([*leaves, *params]), None)
        self.device = first.device if first is not None else torch.device("cpu")
        """Where outputs go: the first tensor argument's device (the module's, with no tensor argument)."""

    def is_rows(self, shape: tuple[int, ...]) -> bool:
        return self.batch is not None and len(shape) > 0 and shape[0] == self.batch


class DropIn:
    """The drop-in forward of ``low`` over ``mesh``'s ``axis``; ``forward_runs`` counts forward programs run."""

    def __init__(self, low: Lowered, mesh: Mesh, axis: str) -> None:
        self.low, self.mesh, self.axis = low, mesh, axis
        self.devices = mesh.shape[axis]
        self.nproc = len({d.process_index for d in mesh.devices.flat})
        """Processes the mesh spans (1 for a process's own devices, whatever the runtime's count)."""
        self._programs: dict[Any, Any] = {}
        self.forward_runs = 0
        """Forward programs executed (one per call; ``backward()`` runs only the VJP's residuals)."""
        self._bwd = jax.jit(lambda vjp, cts: vjp(cts))
        self._zeros: dict[Any, Any] = {}

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        """``x`` laid out as ``spec`` inside a program (dim 0 may not divide the axis: XLA splits it unevenly)."""
        if all(t == AxisType.Auto for t in self.mesh.axis_types):
            return jax.lax.with_sharding_constraint(x, self.sharding(spec))
        return jax.sharding.reshard(x, self.sharding(spec))

    def __call__(
        self,
        training: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        key: jax.Array,
        finish: Any = None,
    ) -> tuple[Any, dict[str, jax.Array]]:
        """``module(*args, **kwargs)``'s output (torch tensors in its structure, differentiable when gradients are
        on) and the buffers after the call (as JAX arrays). ``finish(params, grads)`` (default: the gradients as
        they are) gives what the backward returns for the parameters, None where it wrote ``param.grad`` itself
        (`openhosti_jax.frontends.torch_sync`)."""
        leaves, spec = flatten((args, kwargs))
        names = self.low.param_names
        call = _Call(self, leaves, [params[n] for n in names])
        program = self._program(training, spec, call)
        p = {n: self._replicated(params[n]) for n in names}
        b = {n: self._replicated(t) for n, t in buffers.items()}
        xs = [self._place(t, r, call) for t, r in zip(leaves, call.rows, strict=True)]
        self.forward_runs += 1
        if not call.needs_grad:
            outs, new_buffers, out_spec = program(p, b, key, xs)
            return unflatten(out_spec.value, [self._out_tensor(o, call) for o in outs]), new_buffers
        diff = [params[n] for n, d in zip(names, call.diff_params, strict=True) if d]
        diff += [t for t, d in zip(leaves, call.diff_inputs, strict=True) if d]
        box: dict[str, Any] = {"finish": finish}
        tensors = _Run.apply(self, program, call, (p, b, key, xs), box, *diff)
        return unflatten(box["spec"], tensors), box["buffers"]

    def _program(self, training: bool, spec: Any, call: _Call) -> Any:
        slot = (training, static_key(spec), call.rows, call.even, call.diff_params, call.diff_inputs, call.needs_grad)
        if slot in self._programs:
            return self._programs[slot]
        low, names = self.low, self.low.param_names

        rows, even, diff_params, diff_inputs = call.rows, call.even, call.diff_params, call.diff_inputs

        def forward(p: Any, b: Any, key: Any, xs: list[Any]) -> tuple[list[Any], Any, Any]:
            batch = next((x.shape[0] for x, r in zip(xs, rows, strict=True) if r), None)  # the global batch
            if not even:  # placed whole: split here, the last device's share short
                xs = [self.constrain(x, P(self.axis)) if r else x for x, r in zip(xs, rows, strict=True)]
            outs, out_spec, new = low.call(p, b, spec, xs, key)
            split = P(self.axis) if even else P()
            outs = [self.constrain(o, split if o.ndim and o.shape[0] == batch else P()) for o in outs]
            return outs, new, _Static(out_spec)

        if not call.needs_grad:
            program = jax.jit(forward)
        else:

            def with_vjp(p: Any, b: Any, key: Any, xs: list[Any]) -> Any:
                fixed = {n: p[n] for n, d in zip(names, diff_params, strict=True) if not d}
                given = [x for x, d in zip(xs, diff_inputs, strict=True) if not d]

                def of_diff(dp: dict[str, Any], dx: list[Any]) -> Any:
                    it, kept = iter(dx), iter(given)
                    full = [next(it) if d else next(kept) for d in diff_inputs]
                    outs, new, out_spec = forward({**fixed, **dp}, b, key, full)
                    return outs, (new, out_spec)

                dp = {n: p[n] for n, d in zip(names, diff_params, strict=True) if d}
                dx = [x for x, d in zip(xs, diff_inputs, strict=True) if d]
                outs, vjp, (new, out_spec) = jax.vjp(of_diff, dp, dx, has_aux=True)
                return outs, vjp, new, out_spec

            program = jax.jit(with_vjp)
        self._programs[slot] = program
        return program

    def _replicated(self, t: torch.Tensor) -> jax.Array:
        if self.nproc == 1:
            return device_value(t, self.sharding(P()))
        return put_value(t.detach().cpu().numpy(), self.sharding(P()))

    def _place(self, t: torch.Tensor, rows: bool, call: _Call) -> jax.Array:
        """An argument on the mesh: batch rows split over the axis (or placed whole when uneven), the rest
        replicated. Each process gives its own rows."""
        if call.nproc == 1:
            return device_value(t, self.sharding(P(self.axis) if rows and call.even else P()))
        value = t.detach().cpu().numpy()
        if rows and call.even:
            if call.nproc == 1:
                return jax.device_put(value, self.sharding(P(self.axis)))
            return jax.make_array_from_process_local_data(self.sharding(P(self.axis)), value)
        if rows and call.nproc > 1:  # every process's rows, in process order, on every process
            value = np.asarray(multihost_utils.process_allgather(value, tiled=True))
        return put_value(value, self.sharding(P()))

    def _out_tensor(self, x: jax.Array, call: _Call) -> torch.Tensor:
        """This process's part of an output as a torch tensor on the call's device (`_out`)."""
        if call.nproc == 1:
            return device_tensor(x, call.device)
        return _to_torch(self._out(x, call)).to(call.device)

    def _out(self, x: jax.Array, call: _Call) -> np.ndarray:
        """This process's part of an output: its rows of a batch-sized one, the whole of any other."""
        if call.nproc == 1 or not call.is_rows(x.shape):
            return host_value(x)
        if call.even:
            return np.asarray(multihost_utils.global_array_to_host_local_array(x, self.mesh, P(self.axis)))
        return host_value(x)[call.pid * call.local : (call.pid + 1) * call.local]

    def _cotangent(self, g: torch.Tensor | None, x: jax.Array, call: _Call) -> Any:
        """The gradient flowing into output ``x`` as ``x`` is laid out: over processes, rows are joined and the
        gradients of a replicated output summed (the average is taken on the parameters' gradients)."""
        if not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
            return np.zeros(x.shape, jax.dtypes.float0)  # a symbolic zero: no data moves
        if call.nproc == 1:
            if g is None:  # made on the devices by a program (eager zeros would send their scalar from the host)
                key = (x.shape, x.dtype, x.sharding)
                if key not in self._zeros:
                    self._zeros[key] = jax.jit(lambda: jax.numpy.zeros(x.shape, x.dtype), out_shardings=x.sharding)
                return self._zeros[key]()
            value = device_value(g, x.sharding)
            return value if value.dtype == x.dtype else value.astype(x.dtype)
        value = np.zeros(x.shape, x.dtype) if g is None else g.detach().cpu().numpy().astype(x.dtype)
        if call.nproc > 1 and call.is_rows(x.shape) and call.even:
            return jax.make_array_from_process_local_data(x.sharding, value)
        if call.nproc > 1:
            every = np.asarray(multihost_utils.process_allgather(value, tiled=call.is_rows(x.shape)))
            value = every if call.is_rows(x.shape) else every.sum(0)
        return put_value(value, x.sharding)


def uneven_train_step(dropin: DropIn, criterion: Any, state: Any) -> Any:
    """The full mode's step for a batch that does not divide the data axis (a DataLoader's short last batch): the
    batch placed whole and split unevenly inside, forward, ``criterion``, gradient and update in one program that keeps
    ``state``'s shardings. ``step(state, (inputs, targets)) -> (state, {"loss": ...})``."""

    def step(state: Any, batch: Any) -> Any:
        inputs, targets = jax.tree.map(lambda x: dropin.constrain(x, P(dropin.axis)) if x.ndim else x, batch)
        state, key = state.next_rng()

        def objective(p: Any, b: Any) -> Any:
            out, new = state.apply_fn(p, *inputs, model_state=b, mutable=True, key=key)
            return criterion(out, targets), new

        (value, buffers), grads = jax.value_and_grad(objective, has_aux=True)(state.params, state.model_state)
        return state.apply_gradients(grads=grads).replace(model_state=buffers), {"loss": value}

    layout = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(step, out_shardings=(layout, NamedSharding(dropin.mesh, P())))


class _Run(torch.autograd.Function):
    """The forward program as an autograd node over the differentiated tensors; its backward runs the VJP."""

    @staticmethod
    def forward(
        ctx: Any, engine: DropIn, program: Any, call: _Call, inputs: Any, box: dict[str, Any], *diff: Any
    ) -> Any:
        outs, vjp, new_buffers, out_spec = program(*inputs)
        box["spec"], box["buffers"] = out_spec.value, new_buffers
        tensors = [engine._out_tensor(o, call) for o in outs]
        ctx.mark_non_differentiable(*[t for t in tensors if not (t.is_floating_point() or t.is_complex())])
        ctx.set_materialize_grads(False)
        ctx.saved = (engine, call, vjp, outs)
        ctx.devices = [t.device for t in diff]  # the parameters', then the differentiated inputs' devices
        ctx.params, ctx.finish = diff[: sum(call.diff_params)], box["finish"]
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not hasattr(ctx, "saved"):
            raise UnsupportedError(
                "Trying to backward through an OptimizedDDP forward a second time: its residuals are freed by the "
                "first backward (retain_graph=True does not keep them); run the forward again"
            )
        engine, call, vjp, outs = ctx.saved
        del ctx.saved  # the residuals go with it
        cts = [engine._cotangent(g, o, call) for g, o in zip(grads, outs, strict=True)]
        dp, dx = engine._bwd(vjp, cts)
        names = [n for n, d in zip(engine.low.param_names, call.diff_params, strict=True) if d]
        devices = iter(ctx.devices)
        if call.nproc == 1:
            param_grads = [device_tensor(dp[n], next(devices)) for n in names]
        else:  # each process's loss is its own batch's: DDP averages over processes
            param_grads = [_to_torch(host_value(dp[n]) / call.nproc).to(next(devices)) for n in names]
        input_grads = [engine._out_tensor(g, call).to(next(devices)) for g in dx]
        if ctx.finish is not None:
            param_grads = ctx.finish(list(ctx.params), param_grads)
        return (None, None, None, None, None, *param_grads, *input_grads)
