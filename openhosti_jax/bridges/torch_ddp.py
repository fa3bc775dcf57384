"""`OptimizedDDP`: replace ``DistributedDataParallel(model)`` with ``OptimizedDDP(model)`` and keep the loop.

``out = model(x)`` runs the module's forward as one jitted JAX program over the mesh's ``data`` axis (the batch split
over the devices, the parameters replicated); ``loss.backward()`` runs its VJP as a second program (it recomputes the
forward: nothing of the first program is kept alive between the two) and writes each parameter's gradient into
``param.grad``, summed over the devices as DDP's all-reduce leaves it; the torch optimizer then steps as before.
Buffers the forward changes (BatchNorm's running statistics and batch counter) are written back in training mode;
``model.eval()`` / ``model.train()`` select the program. Dropout draws its masks from JAX's generator (``seed``), not
torch's; the backward reuses the forward's masks. Not yet: several processes, the full mode with the planner.

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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.bridges.torch_lowering import Lowered, lower
from openhosti_jax.errors import BatchError, BridgeError


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
        return torch.from_numpy(np.array(out))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ddp, p, b, key, x = ctx.saved
        del ctx.saved
        grads = ddp._program("backward")(p, b, key, x, ddp._split(grad))  # the forward's dropout masks again
        param_grads = (torch.from_numpy(np.array(grads[n])) for n in ddp._low.param_names)
        return (None, None, *[None] * len(x), *param_grads)


class OptimizedDDP(torch.nn.Module):
    """``module`` trained data-parallel over ``mesh``'s ``data_axis`` (default: every device on one axis), its
    forward and backward lowered to JAX (`openhosti_jax.bridges.torch_lowering`)."""

    def __init__(
        self, module: torch.nn.Module, mesh: Mesh | None = None, data_axis: str = "data", seed: int = 0
    ) -> None:
        super().__init__()
        self._key = jax.random.key(seed)
        self.module = module
        self.mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), (data_axis,))
        if data_axis not in self.mesh.axis_names:
            raise BridgeError(f"the mesh has axes {self.mesh.axis_names}, not {data_axis!r}; pass data_axis=")
        self.data_axis = data_axis
        self._low: Lowered = lower(module)
        self._programs: dict[tuple[str, bool], Any] = {}

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        bad = [i for i, t in enumerate(inputs) if not isinstance(t, torch.Tensor)]
        if bad:
            raise BridgeError(f"OptimizedDDP takes tensors as positional inputs; inputs {bad} are not tensors")
        named = dict(self.module.named_parameters())
        return _Run.apply(self, len(inputs), *inputs, *(named[n] for n in self._low.param_names))

    def _next_key(self) -> jax.Array:
        self._key, key = jax.random.split(self._key)
        return key

    def _replicated(self, t: torch.Tensor) -> jax.Array:
        return jax.device_put(t.detach().cpu().numpy(), NamedSharding(self.mesh, P()))

    def _split(self, t: torch.Tensor) -> jax.Array:
        n = self.mesh.shape[self.data_axis]
        if t.ndim == 0 or t.shape[0] % n:
            raise BatchError(
                f"OptimizedDDP splits dim 0 of each input over {n} devices; found shape {tuple(t.shape)}. Give a "
                f"batch that is a multiple of {n}"
            )
        return jax.device_put(t.detach().cpu().numpy(), NamedSharding(self.mesh, P(self.data_axis)))

    def _buffers_now(self) -> dict[str, torch.Tensor]:
        named = dict(self.module.named_buffers())
        return {n: named[n] for n in self._low.buffer_names}

    def _write_buffers(self, new: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, t in self._buffers_now().items():
                t.copy_(torch.from_numpy(np.array(new[n])))

    def _program(self, kind: str) -> Any:
        """The jitted forward or backward for the module's current mode (train / eval trace differently)."""
        key = (kind, self.module.training)
        if key not in self._programs:
            apply = self._low.apply
            if kind == "forward":

                def forward(p: Any, b: Any, key: Any, *x: Any) -> Any:  # one function per mode: jax caches by it
                    return apply(p, b, *x, key=key)

                self._programs[key] = jax.jit(forward)
            else:

                def vjp(p: Any, b: Any, key: Any, x: Any, g: Any) -> Any:
                    _, pull = jax.vjp(lambda q: apply(q, b, *x, key=key)[0], p)
                    return pull(g)[0]

                self._programs[key] = jax.jit(vjp)
        return self._programs[key]
