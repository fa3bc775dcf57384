"""DDP's gradient accumulation for `OptimizedDDP`'s drop-in mode: ``no_sync()`` and ``require_backward_grad_sync``.

torch's documented loop accumulates over micro steps and reduces once per window::

    for i, (x, y) in enumerate(batches):
        if (i + 1) % k:
            with model.no_sync():
                loss_fn(model(x), y).backward()
        else:
            loss_fn(model(x), y).backward()
            optimizer.step(); optimizer.zero_grad()

nanoGPT's form sets ``model.require_backward_grad_sync = (i + 1) % k == 0`` instead. As DDP, the flag is read at
the forward. A backward whose forward ran without sync is this process's alone: its forward and VJP run on the
process's own devices (no collective across processes) and torch accumulates the process's gradient into
``param.grad`` as DDP leaves it. The next backward with sync reduces what ``param.grad`` holds plus its own
gradient across the processes, once: ``param.grad`` is the mean over processes of the window's summed gradients,
DDP's result. A backward with sync and no window open is the drop-in's usual global program. `GradSync.syncs`
counts the backward passes that reduced across processes (on one process, where nothing is reduced across
processes, the backward passes with sync on).

In a window BatchNorm normalises over each process's rows, as DDP's does, and its buffers are broadcast from
process 0 before each forward, as DDP's ``broadcast_buffers`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import torch
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.bridges.torch_lowering import Lowered
from openhosti_jax.errors import BridgeError
from openhosti_jax.frontends.torch_dropin import DropIn

Finish = Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor | None]]
"""``finish(params, grads)``: what a backward returns for its parameters (None where it wrote ``param.grad``)."""


class GradSync:
    """The accumulation state of one `OptimizedDDP`: the flag, the open window and the count of reductions."""

    def __init__(self, low: Lowered, mesh: Mesh, axis: str) -> None:
        self.low, self.mesh, self.axis = low, mesh, axis
        self.require_backward_grad_sync = True
        """DDP's flag: whether the next forward's backward reduces gradients across processes."""
        self.syncs = 0
        """Backward passes that reduced gradients across processes (see the module docstring)."""
        self.window_open = False
        """Whether ``param.grad`` holds this process's gradients of backward passes without sync."""
        self._inside = False
        self._local: DropIn | None = None
        self._reducers: dict[Any, Any] = {}

    @contextlib.contextmanager
    def no_sync(self, owner: Any) -> Iterator[None]:
        """DDP's ``no_sync()``: backward passes of forwards run inside accumulate without reducing."""
        if self._inside:
            raise BridgeError(
                "OptimizedDDP.no_sync() entered twice: expected one no_sync() per accumulation window, found it "
                "entered again inside itself; leave the outer one first (the window ends at the first backward "
                "outside it, which reduces the accumulated gradients once)"
            )
        old = owner.require_backward_grad_sync
        self._inside, owner.require_backward_grad_sync = True, False
        try:
            yield
        finally:
            self._inside, owner.require_backward_grad_sync = False, old

    def engine(self, default: DropIn, sync: bool) -> tuple[DropIn, Finish]:
        """(the program engine a forward runs on, what its backward does with its parameters' gradients), for a
        forward whose backward syncs or not."""
        if jax.process_count() == 1:  # nothing to reduce across: the usual program, torch accumulating into .grad
            return default, self._count if sync else _keep
        if not sync:
            return self._local_engine(), self._accumulate
        if self.window_open:
            return self._local_engine(), self._reduce_window
        return default, self._count

    def _local_engine(self) -> DropIn:
        if self._local is None:
            devices = np.asarray(jax.local_devices())
            self._local = DropIn(self.low, Mesh(devices, (self.axis,)), self.axis)
        return self._local

    def _count(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
        self.syncs += 1
        return list(grads)

    def _accumulate(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
        self.window_open = True
        return list(grads)  # this process's own: torch adds them into param.grad, as DDP under no_sync

    def _reduce_window(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """``param.grad`` := the mean over processes of (``param.grad`` + this backward's gradient): one
        all-reduce of the whole window."""
        totals = [g if p.grad is None else p.grad + g for p, g in zip(params, grads, strict=True)]
        reduced = self._allreduce_mean(totals)
        with torch.no_grad():
            for p, value in zip(params, reduced, strict=True):
                p.grad = torch.from_numpy(value).to(device=p.device, dtype=p.dtype)
        self.window_open = False
        self.syncs += 1
        return [None] * len(params)  # written: torch adds nothing more

    def _allreduce_mean(self, values: list[torch.Tensor]) -> list[np.ndarray]:
        """The mean over processes of each process's ``values``, by one program whose only collective reduces over
        one device per process."""
        n = jax.process_count()
        firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(n)]
        mesh = Mesh(np.asarray(firsts), ("processes",))
        rows = NamedSharding(mesh, P("processes"))
        host = [v.detach().cpu().numpy()[None] for v in values]
        key = tuple((x.shape, x.dtype.str) for x in host)
        if key not in self._reducers:
            whole = NamedSharding(mesh, P())
            self._reducers[key] = jax.jit(lambda xs: [x.sum(0) / n for x in xs], out_shardings=[whole] * len(host))
        placed = [jax.make_array_from_process_local_data(rows, x) for x in host]
        return [np.array(x.addressable_data(0)) for x in self._reducers[key](placed)]

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Every process's buffers from process 0's, as DDP's ``broadcast_buffers`` (around a window)."""
        names = self.low.buffer_names
        if jax.process_count() == 1 or not names:
            return
        named = dict(module.named_buffers())
        state = {n: named[n].detach().cpu().numpy() for n in names}
        with torch.no_grad():
            for n, v in multihost_utils.broadcast_one_to_all(state).items():
                named[n].copy_(torch.from_numpy(np.array(v)))


def _keep(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return list(grads)
