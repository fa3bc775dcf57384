"""`OptimizedDDP`: replace ``DistributedDataParallel(model)`` with ``OptimizedDDP(model)`` and keep the loop.

``out = model(x)`` runs the module's forward as one jitted JAX program over the mesh's ``data`` axis (the batch split
over the devices, the parameters replicated); ``loss.backward()`` runs its VJP as a second program (it recomputes the
forward: nothing of the first program is kept alive between the two) and writes each parameter's gradient into
``param.grad``, summed over the devices as DDP's all-reduce leaves it; the torch optimizer then steps as before.
Buffers the forward changes (BatchNorm's running statistics and batch counter) are written back in training mode;
``model.eval()`` / ``model.train()`` select the program. Dropout draws its masks from JAX's generator (``seed``), not
torch's; the backward reuses the forward's masks. Under torchrun each process passes its own batch and gets its own
rows of the output back; the runtime starts from torchrun's variables, process 0's parameters and buffers are
broadcast as DDP broadcasts them, and gradients are averaged over the processes. Batch norm normalises over the
global batch (as ``SyncBatchNorm``), where DDP's normalises over each process's.

The full mode, ``OptimizedDDP(module, optimizer=opt, loss_fn=loss, plan="fsdp")`` then ``model.train_step(x, y)``,
maps the torch optimizer to optax (`openhosti_jax.bridges.torch_optim`: AdamW, Adam, SGD, their groups) and runs
forward, loss, gradient and update as one program whose parameters and optimizer state the plan shards (ZeRO-3 by
default); `state_dict` writes the trained weights back into the module. Buffers stay as they were (BatchNorm's
running statistics are not updated in this mode).

Example:
    >>> import torch
    >>> model = OptimizedDDP(torch.nn.Linear(4, 2))
    >>> loss = model(torch.ones(8, 4)).pow(2).mean()
    >>> loss.backward()
    >>> model.module.weight.grad.shape
    torch.Size([2, 4])
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.bridges.torch_lowering import Lowered, lower, lower_function
from openhosti_jax.bridges.torch_optim import optax_from_torch
from openhosti_jax.errors import BatchError, BridgeError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.mesh.distributed import initialize_distributed
from openhosti_jax.train.create import Strategy, create_train_state
from openhosti_jax.train.spmd import spmd


def _local(x: jax.Array) -> np.ndarray:
    """A replicated array's value on this process (a writable copy)."""
    return np.array(x.addressable_data(0))


class _Run(torch.autograd.Function):
    """The lowered forward as an autograd node: its backward writes the parameters' gradients."""

    @staticmethod
    def forward(ctx: Any, ddp: OptimizedDDP, n_in: int, *tensors: torch.Tensor) -> torch.Tensor:
        inputs, params = tensors[:n_in], tensors[n_in:]
        p = {n: ddp._replicated(t) for n, t in zip(ddp._low.param_names, params, strict=True)}
        b = {n: ddp._replicated(t) for n, t in ddp._buffers_now().items()}
        x = tuple(ddp._split(t) for t in inputs)
        key = ddp._next_key()
        out, new_buffers = ddp._program("forward")(p, b, key, *x)
        if ddp.module.training:
            ddp._write_buffers(new_buffers)
        ctx.saved = (ddp, p, b, key, x)
        return torch.from_numpy(np.array(multihost_utils.global_array_to_host_local_array(out, ddp.mesh, ddp._rows)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ddp, p, b, key, x = ctx.saved
        del ctx.saved
        grads = ddp._program("backward")(p, b, key, x, ddp._split(grad))  # the forward's dropout masks again
        # each process's loss is its own batch's, so the program's sum over processes is averaged, as DDP does
        scale = 1.0 / jax.process_count()
        param_grads = (torch.from_numpy(_local(grads[n]) * scale) for n in ddp._low.param_names)
        return (None, None, *[None] * len(x), *param_grads)


class OptimizedDDP(torch.nn.Module):
    """``module`` trained data-parallel over ``mesh``'s ``data_axis`` (default: the library's mesh with every device
    on ``data``), its forward and backward lowered to JAX (`openhosti_jax.bridges.torch_lowering`)."""

    def __init__(
        self,
        module: torch.nn.Module,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        seed: int = 0,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Any = None,
        plan: Strategy = "fsdp",
    ) -> None:
        super().__init__()
        if (optimizer is None) != (loss_fn is None):
            raise BridgeError(
                "the full mode takes both optimizer= (a torch optimizer) and loss_fn=(output, targets) -> loss; the "
                "drop-in mode takes neither"
            )
        initialize_distributed()  # torchrun's (or openhosti launch's) environment: one JAX runtime over the processes
        self._key = jax.random.key(seed)
        self.module = module
        self.mesh = mesh if mesh is not None else build_mesh(MeshConfig(data=-1))
        if data_axis not in self.mesh.axis_names:
            raise BridgeError(f"the mesh has axes {self.mesh.axis_names}, not {data_axis!r}; pass data_axis=")
        self.data_axis = data_axis
        self._rows = P(data_axis)
        self._low: Lowered = lower(module)
        self._programs: dict[tuple[str, bool], Any] = {}
        self._full: dict[str, Any] | None = None
        if optimizer is not None:
            named = dict(module.named_parameters())
            tx = optax_from_torch(optimizer, {n: named[n] for n in self._low.param_names})
            self._full = {
                "tx": tx,
                "loss": lower_function(loss_fn),
                "plan": plan,
                "state": None,
                "step": None,
                "dirty": False,  # trained weights not yet written back into the module
            }
        if jax.process_count() > 1:  # as DDP does: every process starts from process 0's parameters and buffers
            with torch.no_grad():
                state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
                for k, v in multihost_utils.broadcast_one_to_all(state).items():
                    module.state_dict()[k].copy_(torch.from_numpy(np.array(v)))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        bad = [i for i, t in enumerate(inputs) if not isinstance(t, torch.Tensor)]
        if bad:
            raise BridgeError(f"OptimizedDDP takes tensors as positional inputs; inputs {bad} are not tensors")
        named = dict(self.module.named_parameters())
        return _Run.apply(self, len(inputs), *inputs, *(named[n] for n in self._low.param_names))

    def train_step(self, inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
        """The full mode's step: forward, ``loss_fn``, gradient and the optimizer's optax update, one jitted program
        sharded by the plan (``"fsdp"``: ZeRO-3 over the data axis; ``"dp"``, ``"zero1"``, ``"zero2"``, ``"auto"``).
        Returns the loss; the module's weights are written back by `state_dict` / `sync_module`."""
        full = self._full
        if full is None:
            raise BridgeError(
                "train_step is the full mode: OptimizedDDP(module, optimizer=torch_optimizer, loss_fn=loss); in the "
                "drop-in mode call model(x), loss.backward() and optimizer.step() as with DDP"
            )
        x = tuple(self._split(t) for t in (inputs if isinstance(inputs, tuple) else (inputs,)))
        y = self._split(targets)
        if full["step"] is None:
            self._build_full(full)
        full["state"], metrics = full["step"](full["state"], (x, y))
        full["dirty"] = True
        return torch.tensor(float(metrics["loss"]))

    @property
    def full_state(self) -> Any:
        """The full mode's train state (parameters sharded by the plan, optax state), or None before a step."""
        return None if self._full is None else self._full["state"]

    def _build_full(self, full: dict[str, Any]) -> None:
        low, loss = self._low, full["loss"]
        params, buffers = low.params(), low.buffers()  # buffers are the module's, unchanged by the full mode

        def apply_fn(p: Any, *inputs: Any, model_state: Any = None, **_: Any) -> Any:
            return low.apply(p, buffers, *inputs)[0]

        def step(state: Any, batch: Any) -> Any:
            x, y = batch
            value, grads = jax.value_and_grad(lambda p: loss(state.apply_fn(p, *x), y))(state.params)
            return state.apply_gradients(grads=grads), {"loss": value}

        full["state"], full["plan"] = create_train_state(
            lambda _: params, full["tx"], self.mesh, plan=full["plan"], apply_fn=apply_fn
        )
        full["step"] = spmd(step, mesh=self.mesh, plan=full["plan"])

    def sync_module(self) -> None:
        """Write the full mode's trained parameters into the torch module."""
        full = self._full
        if full is None or not full["dirty"]:
            return
        named = dict(self.module.named_parameters())
        with torch.no_grad():
            for n, v in full["state"].params.items():
                value = multihost_utils.process_allgather(v, tiled=True) if jax.process_count() > 1 else v
                named[n].copy_(torch.from_numpy(np.array(value)))
        full["dirty"] = False

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's state dict (as DDP's, keys under ``module.``), the full mode's weights written back first."""
        self.sync_module()
        return super().state_dict(*args, **kwargs)

    def _next_key(self) -> jax.Array:
        self._key, key = jax.random.split(self._key)
        return key

    def _replicated(self, t: torch.Tensor) -> jax.Array:
        value = t.detach().cpu().numpy()
        return jax.make_array_from_callback(value.shape, NamedSharding(self.mesh, P()), lambda index: value[index])

    def _split(self, t: torch.Tensor) -> jax.Array:
        """This process's batch (dim 0), as its rows of the global batch over the data axis."""
        n = self.mesh.shape[self.data_axis] // jax.process_count()
        if t.ndim == 0 or t.shape[0] % n:
            raise BatchError(
                f"OptimizedDDP splits dim 0 of each input over this process's {n} devices; found shape "
                f"{tuple(t.shape)}. Give a batch that is a multiple of {n}"
            )
        value = t.detach().cpu().numpy()
        return jax.make_array_from_process_local_data(NamedSharding(self.mesh, self._rows), value)

    def _buffers_now(self) -> dict[str, torch.Tensor]:
        named = dict(self.module.named_buffers())
        return {n: named[n] for n in self._low.buffer_names}

    def _write_buffers(self, new: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, t in self._buffers_now().items():
                t.copy_(torch.from_numpy(_local(new[n])))

    def _program(self, kind: str) -> Any:
        """The jitted forward or backward for the module's current mode (train / eval trace differently)."""
        slot = (kind, self.module.training)
        if slot not in self._programs:
            apply = self._low.apply
            if kind == "forward":

                def forward(p: Any, b: Any, key: Any, *x: Any) -> Any:  # one function per mode: jax caches by it
                    return apply(p, b, *x, key=key)

                self._programs[slot] = jax.jit(forward)
            else:

                def vjp(p: Any, b: Any, key: Any, x: Any, g: Any) -> Any:
                    _, pull = jax.vjp(lambda q: apply(q, b, *x, key=key)[0], p)
                    return pull(g)[0]

                self._programs[slot] = jax.jit(vjp)
        return self._programs[slot]
