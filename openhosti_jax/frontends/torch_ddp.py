"""`OptimizedDDP`: replace ``DistributedDataParallel(model)`` with ``OptimizedDDP(model)`` and keep the loop.

``out = model(*args, **kwargs)`` runs the module's forward as one jitted JAX program over the mesh's ``data`` axis
(the batch split over the devices, the parameters replicated; `openhosti_jax.frontends.torch_dropin`): any batch size (a
DataLoader's short last batch is split unevenly, its means and statistics over the real rows), keyword and non-tensor
arguments, outputs of any structure (tensor, tuple, dict, dataclass, transformers' ``ModelOutput``, so
``outputs.loss.backward()`` works). The program keeps the VJP's residuals; ``loss.backward()`` runs only the VJP
(the forward runs once per step) and writes each parameter's gradient into ``param.grad``, summed over the devices as
DDP's all-reduce leaves it; the torch optimizer and its schedulers then step as before. Buffers the forward changes
(BatchNorm's running statistics and batch counter) are written back in training mode; ``model.eval()`` /
``model.train()`` select the program. Dropout draws its masks from JAX's generator (``seed``), not torch's. Under
torchrun each process passes its own batch and gets its own rows of the output back; the runtime starts from
torchrun's variables, process 0's parameters and buffers are broadcast as DDP broadcasts them, and gradients are
averaged over the processes. Batch norm normalises over the global batch (as ``SyncBatchNorm``), where DDP's
normalises over each process's. DDP's accumulation idioms work as DDP's: ``with model.no_sync(): loss.backward()``
for the micro steps, or ``model.require_backward_grad_sync = False``, reduce once per window
(`openhosti_jax.frontends.torch_sync`).

The full mode, ``OptimizedDDP(module, optimizer=opt, criterion=loss, plan="fsdp")`` then ``model.train_step(x, y)``
(``criterion(outputs, targets) -> loss``, a torch loss such as ``torch.nn.functional.cross_entropy``),
maps the torch optimizer to optax (`openhosti_jax.bridges.torch_optim`: SGD, Adam(W), Adamax, NAdam, RAdam, Adadelta,
Adagrad, RMSprop with their options and groups, as torch steps them; each step reads every group's ``lr`` (momentum,
betas, ...) from ``optimizer.param_groups``, so a torch LR scheduler stepped in the loop is honoured) and runs
forward, loss, gradient and update as one program whose parameters and optimizer state the plan shards (by
default the planner chooses the ZeRO stage, as every door does where no plan is named; ``plan="fsdp"``, ``"dp"``,
``"zero1"``, ``"zero2"`` fix it). The drop-in mode has no plan to choose: as DDP, the weights are torch's and
replicated, so ``plan=`` belongs to the full mode. The buffers ride in the train state's ``model_state``: BatchNorm's
running statistics are updated as torch
updates them. ``model.eval()`` / ``model.train()`` select the program (one each). A batch that does not divide the
data axis, the microbatches or the balancer's pieces (a DataLoader's short last batch) runs whole in a program of
its own that splits it unevenly over the devices (its gradient is the mean over its real rows; without accumulation
or balancing for that one batch, so its BatchNorm statistics update once). ``microbatch=k`` accumulates the
gradient over k microbatches of the first batch (microbatch i: rows i, i + k, ...; the loss is taken as a mean over
the rows, as torch's losses are, so the gradient is the mean of the microbatches'; BatchNorm's statistics update once
per microbatch, as in torch's accumulation loop); ``microbatch="auto"`` picks the largest microbatch whose compiled
peak fits ``memory_budget``. Later batches keep the microbatch size, and an out-of-memory step halves it and re-runs
(`openhosti_jax.spmd`). Dropout draws from the train state's key (``seed``). ``checkpoint_dir=`` saves the whole
train state (parameters, optimizer state, buffers, key) through `openhosti_jax.checkpoint.CheckpointManager` every
``every_steps`` steps (else every 15 minutes; ``replicate_to=`` an object-store URL or path that receives a copy of
each good step in the background, from which a machine that lost its disk resumes; `save_checkpoint` saves now, `close`
waits for saves in flight), and a
new ``OptimizedDDP`` on the same directory resumes from its latest good step at its first ``train_step``;
iterating ``model.loader(data_loader)`` instead of the DataLoader itself saves its position (epoch, batch, the
sampler's epoch-seeded order) with each checkpoint, and resumes at the batch after the restored step's.
`state_dict` writes the trained weights and buffers back into the module; `load_state_dict` (or `load_module` after
changing the module directly) takes the module's values into the train state, keeping the optimizer state.

``balance=True, balance_microbatches=N`` makes the full mode's step a load-balanced one
(`openhosti_jax.balanced_step`): each batch is cut into N microbatches of consecutive rows, which a
`openhosti_jax.balance.Balancer` spreads over the data axis by measured speed (keyword arguments it takes, e.g.
``throttle=``, ``every=``, pass through); it is not ``microbatch=``, the accumulation steps of the unbalanced step,
and the two are refused together. Any plan works, ZeRO-3 (``"fsdp"``) included: the balanced step gathers the
sharded parameters once per step and reduce-scatters the gradient. The criterion, a mean over rows, counts as
``(mean * rows, rows)`` per microbatch, so the gradient is the mean over the batch's rows as torch's (exact when
every row weighs the same in the mean, as in a mean over rows or over a fixed number of tokens per row). The plan
defaults to ``"dp"``; modules with buffers are refused (BatchNorm statistics would have to be combined per
microbatch as SyncBatchNorm does, and balanced devices run different numbers of microbatches at once). Microbatch
k's dropout key is ``fold_in`` of the step's key and k, whichever device runs it.

Example:
    >>> import torch
    >>> model = OptimizedDDP(torch.nn.Linear(4, 2))
    >>> loss = model(torch.ones(8, 4)).pow(2).mean()
    >>> loss.backward()
    >>> model.module.weight.grad.shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from openhosti_jax.balance import Balancer
from openhosti_jax.bridges.torch_data import TorchBatches
from openhosti_jax.bridges.torch_lowering import Lowered, lower, lower_function
from openhosti_jax.bridges.torch_optim import TorchOptimizer, set_hyperparams
from openhosti_jax.checkpoint import CheckpointManager
from openhosti_jax.errors import BatchError, BridgeError
from openhosti_jax.frontends.torch_dropin import DropIn, device_tensor, host_value, put_value, uneven_train_step
from openhosti_jax.frontends.torch_sync import GradSync
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.mesh.distributed import initialize_distributed
from openhosti_jax.microbatch import split_microbatches
from openhosti_jax.state.context import constrain_gradients, current_microbatches
from openhosti_jax.state.init import abstract_train_state
from openhosti_jax.train.balanced import BalancedStep
from openhosti_jax.train.create import PlanChoice, create_train_state
from openhosti_jax.train.spmd_step import SpmdStep, spmd

_RENAMED = {"loss_fn": "criterion", "microbatches": "balance_microbatches"}
"""Former option names and their names now: a caller using one gets an error naming the new one."""


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
        criterion: Any = None,
        plan: PlanChoice | None = None,
        microbatch: int | str | None = None,
        memory_budget: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        replicate_to: str | os.PathLike[str] | None = None,
        every_steps: int | None = None,
        keep: int | None = 3,
        balance: bool = False,
        balance_microbatches: int | None = None,
        **balancer_kw: Any,
    ) -> None:
        super().__init__()
        renamed = {k: _RENAMED[k] for k in balancer_kw if k in _RENAMED}
        if renamed:
            raise BridgeError(
                f"OptimizedDDP's options {sorted(renamed)} are named {sorted(renamed.values())} now "
                "(criterion=: the torch loss; balance_microbatches=: the pieces balance=True cuts each batch into; "
                f"microbatch=: gradient-accumulation steps); found {sorted(renamed)}; rename them"
            )
        if (optimizer is None) != (criterion is None):
            raise BridgeError(
                "the full mode takes both optimizer= (a torch optimizer) and criterion=(output, targets) -> loss; "
                "the drop-in mode takes neither"
            )
        if not balance and (balance_microbatches is not None or balancer_kw):
            given = sorted({*balancer_kw, *(["balance_microbatches"] if balance_microbatches is not None else [])})
            raise BridgeError(
                f"{given} configure the load-balanced step: expected OptimizedDDP(module, optimizer=..., "
                f"criterion=..., balance=True, {given[0]}=...), found balance=False; pass balance=True, or drop "
                f"{given} (gradient accumulation without balance is microbatch=)"
            )
        full_only = {
            "plan": plan,
            "microbatch": microbatch,
            "memory_budget": memory_budget,
            "checkpoint_dir": checkpoint_dir,
            "replicate_to": replicate_to,
            "balance": balance or None,
        }
        given = sorted(k for k, v in full_only.items() if v is not None)
        if optimizer is None and given:
            raise BridgeError(
                f"{given} belong to the full mode: expected OptimizedDDP(module, optimizer=..., criterion=..., "
                f"{given[0]}=...), found no optimizer; pass optimizer= and criterion=, or drop {given}"
            )
        if every_steps is not None and checkpoint_dir is None:
            raise BridgeError("every_steps= says how often to save into checkpoint_dir=; pass checkpoint_dir= too")
        initialize_distributed()  # torchrun's (or openhosti launch's) environment: one JAX runtime over the processes
        self._key = jax.random.key(seed)
        self._batches: TorchBatches | None = None  # `loader`'s iterator: its position is saved with each checkpoint
        self.module = module
        self.mesh = mesh if mesh is not None else build_mesh(MeshConfig(data=-1))
        if data_axis not in self.mesh.axis_names:
            raise BridgeError(f"the mesh has axes {self.mesh.axis_names}, not {data_axis!r}; pass data_axis=")
        self.data_axis = data_axis
        self._rows = P(data_axis)
        self._low: Lowered = lower(module)
        self._dropin = DropIn(self._low, self.mesh, data_axis)
        self._grad_sync = GradSync(self._low, self.mesh, data_axis)
        self.require_backward_grad_sync = True
        """DDP's flag, read at each forward: whether its backward reduces gradients across processes (`no_sync`
        turns it off for the forwards inside it; nanoGPT sets it directly)."""
        if balance:
            plan = "dp" if plan is None else plan
            self._check_balance(plan, microbatch, memory_budget, balance_microbatches, balancer_kw)
        plan = "auto" if plan is None else plan
        self._full: dict[str, Any] | None = None
        self.checkpoints: CheckpointManager | None = None
        """The full mode's `CheckpointManager` over ``checkpoint_dir`` (None without one)."""
        if optimizer is not None:
            named = dict(module.named_parameters())
            torch_opt = TorchOptimizer(optimizer, {n: named[n] for n in self._low.param_names})
            self._full = {
                "optimizer": torch_opt,
                "hyper": None,  # the hyperparameters the train state holds (a scheduler changes param_groups')
                "tx": torch_opt.tx,
                "criterion": lower_function(criterion),
                "plan": plan,
                "seed": seed,
                "microbatch": microbatch,
                "memory_budget": memory_budget,
                "balance": {"microbatches": balance_microbatches, **balancer_kw} if balance else None,
                "state": None,
                "steps": {},  # the SpmdStep (or BalancedStep) of each mode (training: True / False)
                "count": 0,  # steps trained (counting those a restored checkpoint had)
                "dirty": False,  # trained weights not yet written back into the module
            }
            if checkpoint_dir is not None:
                self.checkpoints = CheckpointManager(
                    checkpoint_dir,
                    every_minutes=None if every_steps else 15.0,
                    every_steps=every_steps,
                    keep=keep,
                    replicate_to=replicate_to,
                )
        if jax.process_count() > 1:  # as DDP does: every process starts from process 0's parameters and buffers
            with torch.no_grad():
                state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
                for k, v in multihost_utils.broadcast_one_to_all(state).items():
                    module.state_dict()[k].copy_(torch.from_numpy(np.array(v)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)`` as one JAX program over the data axis (`openhosti_jax.frontends.torch_dropin`):
        any batch size, keyword and non-tensor arguments, any output structure; ``backward()`` fills ``param.grad``
        (reducing across processes unless ``require_backward_grad_sync`` is off: `no_sync`)."""
        self.sync_module()  # the full mode's trained weights, when it has trained
        named = dict(self.module.named_parameters())
        training = self.module.training
        engine, finish = self._grad_sync.engine(self._dropin, bool(self.require_backward_grad_sync))
        if engine is not self._dropin or self._grad_sync.window_open:
            self._grad_sync.broadcast_buffers(self.module)  # as DDP's broadcast_buffers, where they may differ
        out, new_buffers = engine(training, args, kwargs, named, self._buffers_now(), self._next_key(), finish)
        if training:
            self._write_buffers(new_buffers)
        if self.full_state is not None and training and self._low.buffer_names:
            self._take_module(params=False)  # the statistics this call updated carry into the next train_step
        return out

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """DDP's context manager for gradient accumulation: the backward passes of forwards run inside it leave this
        process's gradients summed in ``param.grad`` without reducing across processes; the first backward after it
        reduces the window's sum once (`openhosti_jax.frontends.torch_sync`). Entered twice (inside itself) is a
        `BridgeError`. The full mode accumulates with ``microbatch=`` instead."""
        return self._grad_sync.no_sync(self)

    @property
    def gradient_syncs(self) -> int:
        """Backward passes that reduced gradients across processes (one per accumulation window)."""
        return self._grad_sync.syncs

    def train_step(self, inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
        """The full mode's step: forward, ``criterion``, gradient and the optimizer's optax update, one jitted program
        sharded by the plan (``"auto"``, the default: the planner's ZeRO stage; ``"fsdp"``: ZeRO-3 over the data
        axis; ``"dp"``, ``"zero1"``, ``"zero2"``), in the module's mode (``train()`` / ``eval()``); with
        ``balance=True`` a load-balanced step
        (`openhosti_jax.balanced_step`, plan ``"dp"`` by default, any ZeRO stage). Returns the loss; the module's
        weights are written back by `state_dict` / `sync_module`. The first step resumes from ``checkpoint_dir``'s
        latest good step if any."""
        full = self._full
        if full is None:
            raise BridgeError(
                "train_step is the full mode: OptimizedDDP(module, optimizer=torch_optimizer, criterion=loss); in the "
                "drop-in mode call model(x), loss.backward() and optimizer.step() as with DDP"
            )
        if not self.require_backward_grad_sync:
            raise BridgeError(
                "train_step steps the optimizer every call, so it has no window to accumulate over: expected it "
                "outside no_sync() (require_backward_grad_sync=True), found it inside; accumulate in the full mode "
                "with OptimizedDDP(..., microbatch=k), or use the drop-in loop (model(x), loss.backward())"
            )
        xs = inputs if isinstance(inputs, tuple) else (inputs,)
        if full["state"] is None:
            self._build_full(full)
            if self.checkpoints is not None and self.checkpoints.latest_good_step() is not None:
                self.restore_checkpoint()
        step = self._full_step(self.module.training)
        uneven = any(t.ndim and not self._cuts_evenly(step, t.shape[0]) for t in (*xs, targets))
        if full["balance"] is not None and not uneven:  # the global batch on the host: the balancer places rows
            batch = (tuple(self._global_host(t) for t in xs), self._global_host(targets))
        elif uneven:  # a short last batch: placed whole, split unevenly inside
            whole = NamedSharding(self.mesh, P())
            batch = jax.tree.map(lambda t: put_value(self._global_host(t), whole), (xs, targets))
            key = ("uneven", self.module.training)
            if key not in full["steps"]:
                full["steps"][key] = uneven_train_step(self._dropin, full["criterion"], full["state"])
            step = full["steps"][key]
        else:
            batch = (tuple(self._split(t) for t in xs), self._split(targets))
        hyper = full["optimizer"].hyperparams()  # the rates (momenta, ...) any scheduler set since the last step
        if hyper != full["hyper"]:
            full["state"] = full["state"].replace(opt_state=set_hyperparams(full["state"].opt_state, hyper))
            full["hyper"] = hyper
        full["state"], metrics = step(full["state"], batch)
        full["optimizer"].optimizer._opt_called = True  # it stepped (in JAX): schedulers check this flag
        full["dirty"] = True
        full["count"] += 1
        if self.checkpoints is not None:
            self.checkpoints.maybe_save(full["count"], full["state"], data_state=self._data_state())
        return torch.tensor(float(metrics["loss"]))

    def loader(self, data_loader: Any, *, num_epochs: int | None = None, seed: int = 0) -> TorchBatches:
        """``data_loader``'s batches over epochs (`openhosti_jax.bridges.torch_data.TorchBatches`: ``set_epoch``
        on its sampler each epoch, its generators reseeded from ``(seed, epoch)``), whose position (epoch, batch,
        seed) every checkpoint saves. With a checkpoint in ``checkpoint_dir`` the train state is restored now and
        the iterator continues at the batch after the last one that checkpoint trained on.

        Example: ``for x, y in model.loader(DataLoader(ds, sampler=DistributedSampler(ds)), num_epochs=3):
        model.train_step(x, y)``."""
        self._batches = TorchBatches(data_loader, seed=seed, num_epochs=num_epochs)
        if self._full is not None and self._full["state"] is None and self.checkpoints is not None:
            if self.checkpoints.latest_good_step() is not None:
                self.restore_checkpoint()
        return self._batches

    def _data_state(self) -> dict[str, Any] | None:
        return None if self._batches is None else self._batches.get_state()

    @property
    def full_state(self) -> Any:
        """The full mode's train state (parameters sharded by the plan, optax state, buffers in ``model_state``),
        or None before a step."""
        return None if self._full is None else self._full["state"]

    @property
    def num_microbatches(self) -> int:
        """Gradient-accumulation steps the full mode's step in the module's current mode runs (1 before a step);
        with ``balance=True``, the microbatches each batch is cut into, over all devices."""
        step = None if self._full is None else self._full["steps"].get(self.module.training)
        if isinstance(step, BalancedStep):
            return step.microbatches
        return 1 if step is None else step.num_microbatches

    @property
    def microbatch_choice(self) -> Any:
        """The `openhosti_jax.microbatch.MicrobatchChoice` of ``microbatch="auto"`` in the module's current mode
        (None before its first step, or without ``"auto"``)."""
        step = None if self._full is None else self._full["steps"].get(self.module.training)
        return step.microbatch_choice if isinstance(step, SpmdStep) else None

    @property
    def balancer(self) -> Balancer | None:
        """With ``balance=True``, the `openhosti_jax.balance.Balancer` of the module's current mode (``counts``: the
        microbatches each data-parallel device runs next step); None before its first step or without balance."""
        step = None if self._full is None else self._full["steps"].get(self.module.training)
        return step.balancer if isinstance(step, BalancedStep) else None

    def _check_balance(
        self, plan: PlanChoice, microbatch: Any, memory_budget: Any, pieces: Any, balancer_kw: dict[str, Any]
    ) -> None:
        """Refuse what a balanced full-mode step cannot do, before anything is traced."""
        if microbatch is not None or memory_budget is not None:
            raise BridgeError(
                "balance=True cuts each batch into balance_microbatches= pieces that the balancer spreads over the "
                "devices; microbatch= (gradient-accumulation steps) and memory_budget= size the unbalanced step's "
                f"accumulation instead; expected neither, found microbatch={microbatch!r}, "
                f"memory_budget={memory_budget!r}; drop them and size the pieces with balance_microbatches="
            )
        if pieces is not None and (isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1):
            raise BridgeError(f"expected balance_microbatches= an int >= 1 (pieces per batch), found {pieces!r}")
        own = {"loss_sum_fn", "mesh", "total", "axis", "grad_shardings"}  # the balanced step sets these
        accepted = set(inspect.signature(Balancer).parameters) - own
        unknown = sorted(set(balancer_kw) - accepted)
        if unknown:
            raise BridgeError(
                f"OptimizedDDP passes extra keyword arguments to the Balancer; expected some of {sorted(accepted)}, "
                f"found {unknown}; fix the names or drop them"
            )
        if self._low.buffer_names:
            raise BridgeError(
                "balance=True cannot carry module buffers: BatchNorm's batch statistics would have to be combined over "
                "the devices per microbatch as torch's SyncBatchNorm combines them, but balanced devices run different "
                "numbers of microbatches at once, so there is no common microbatch to take them over; "
                f"expected a module without buffers, found {list(self._low.buffer_names)}; use the full mode without "
                "balance, or a module without them (e.g. LayerNorm or GroupNorm for BatchNorm)"
            )

    def _balanced_loss(self) -> Any:
        """``loss_sum_fn(params, (inputs, targets), rng) -> (mean * rows, rows)``: the criterion (a mean over rows)
        as the sum and count `openhosti_jax.balanced_step` averages exactly over the devices."""
        full = self._full
        assert full is not None
        low, criterion = self._low, full["criterion"]

        def loss_sum_fn(params: Any, mb: Any, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
            inputs, targets = mb
            out, _ = low.apply(params, {}, *inputs, key=rng)
            value = jnp.asarray(criterion(out, targets))
            if value.ndim:
                raise BridgeError(
                    f"balance=True takes criterion's value as a mean over the rows; expected a scalar, found shape "
                    f"{value.shape}; use the loss's default reduction='mean'"
                )
            rows = targets.shape[0]
            return value * jnp.asarray(rows, value.dtype), jnp.float32(rows)

        return loss_sum_fn

    def _build_full(self, full: dict[str, Any]) -> None:
        low = self._low
        params, buffers = low.params(), low.buffers()

        def apply_fn(p: Any, *inputs: Any, model_state: Any = None, mutable: bool = False, key: Any = None) -> Any:
            out, new = low.apply(p, buffers if model_state is None else model_state, *inputs, key=key)
            return (out, new) if mutable else out

        full["state"], full["plan"] = create_train_state(
            lambda _: params, full["tx"], self.mesh, plan=full["plan"], apply_fn=apply_fn, seed=full["seed"]
        )
        full["state"] = full["state"].replace(model_state={n: self._replicated_value(v) for n, v in buffers.items()})

    def _cuts_evenly(self, step: SpmdStep | BalancedStep, rows: int) -> bool:
        """Whether ``step`` cuts this process's ``rows`` evenly: over the devices, and over the microbatches (their
        per-device size, which the first batch fixed; a first batch that ``microbatch=k`` does not divide is the
        step's BatchError) or the balancer's pieces (over the global batch). A batch it does not cut (a
        DataLoader's short last batch) runs in the uneven program."""
        per_process = self.mesh.shape[self.data_axis] // jax.process_count()
        if isinstance(step, BalancedStep):
            return rows % per_process == 0 and (rows * jax.process_count()) % step.microbatches == 0
        return rows % (per_process * (step.microbatch_rows or 1)) == 0

    def _full_step(self, training: bool) -> SpmdStep | BalancedStep:
        """The full mode's `SpmdStep` (with ``balance=True``: `BalancedStep`) for the module's mode (each traces the
        module in its own mode)."""
        full = self._full
        assert full is not None
        if training in full["steps"]:
            return full["steps"][training]
        if full["balance"] is not None:
            kw = dict(full["balance"])
            n = kw.pop("microbatches") or 4 * self.mesh.shape[self.data_axis]
            loss_sum_fn = self._balanced_loss()  # traced in the module's current mode, as the key says
            full["steps"][training] = BalancedStep(
                loss_sum_fn, self.mesh, full["plan"], microbatches=n, axis=self.data_axis, **kw
            )
            return full["steps"][training]
        criterion = full["criterion"]
        holder: list[SpmdStep] = []

        def step(state: Any, batch: Any) -> Any:
            state, key = state.next_rng()
            k = current_microbatches()

            def objective(p: Any, b: Any, mb: Any, key: Any) -> Any:
                out, new = state.apply_fn(p, *mb[0], model_state=b, mutable=True, key=key)
                return criterion(out, mb[1]), new

            grad_fn = jax.value_and_grad(objective, has_aux=True)
            if k == 1:
                (value, buffers), grads = grad_fn(state.params, state.model_state, batch, key)
            else:  # microbatch i: rows i, i + k, ... (each device keeps its rows); buffers update in sequence
                rows = NamedSharding(self.mesh, holder[0].plan.batch_spec)
                stacked = split_microbatches(batch, k, microbatch_sharding=rows)

                def body(carry: Any, xs: Any) -> Any:
                    g_acc, l_acc, b = carry
                    i, mb = xs
                    (value, b), g = grad_fn(state.params, b, mb, jax.random.fold_in(key, i))
                    g_acc = constrain_gradients(jax.tree.map(jnp.add, g_acc, g))
                    return (g_acc, l_acc + value.astype(l_acc.dtype), b), None

                zeros = constrain_gradients(jax.tree.map(jnp.zeros_like, state.params))
                init = (zeros, jnp.zeros((), jnp.float32), state.model_state)
                (g_sum, l_sum, buffers), _ = jax.lax.scan(body, init, (jnp.arange(k), stacked))
                grads, value = jax.tree.map(lambda g: g / k, g_sum), l_sum / k
            return state.apply_gradients(grads=grads).replace(model_state=buffers), {"loss": value}

        holder.append(
            spmd(
                step,
                mesh=self.mesh,
                plan=full["plan"],
                microbatch=full["microbatch"],
                memory_budget=full["memory_budget"],
            )
        )
        full["steps"][training] = holder[0]
        return holder[0]

    def sync_module(self) -> None:
        """Write the full mode's trained parameters and buffers into the torch module."""
        full = self._full
        if full is None or not full["dirty"]:
            return
        state = full["state"]
        named = dict(self.module.named_parameters())
        with torch.no_grad():
            for n, v in state.params.items():
                value = multihost_utils.process_allgather(v, tiled=True) if jax.process_count() > 1 else v
                named[n].copy_(torch.from_numpy(np.array(value)))
        self._write_buffers(state.model_state)
        full["dirty"] = False

    def load_module(self) -> None:
        """Take the module's current parameters and buffers into the full mode's train state (the optimizer state
        stays): after changing the module directly, e.g. ``model.module.load_state_dict(...)``."""
        if self.full_state is not None:
            self._take_module(params=True)
            self._full["dirty"] = False  # type: ignore[index]

    def _take_module(self, params: bool) -> None:
        full = self._full
        assert full is not None
        state = full["state"]
        buffers = {n: self._like(t, state.model_state[n]) for n, t in self._buffers_now().items()}
        if params:
            named = dict(self.module.named_parameters())
            state = state.replace(params={n: self._like(named[n], v) for n, v in state.params.items()})
        full["state"] = state.replace(model_state=buffers)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's state dict (as DDP's, keys under ``module.``), the full mode's weights written back first."""
        self.sync_module()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the module (keys under ``module.``, as `state_dict` gives them), then into the full mode's
        train state (its optimizer state stays, as a torch optimizer's does)."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.load_module()
        return result

    def save_checkpoint(self, wait: bool = True) -> int:
        """Save the full mode's train state into ``checkpoint_dir`` now, as the step count trained; returns it."""
        full = self._full
        if self.checkpoints is None or full is None or full["state"] is None:
            raise BridgeError(
                "save_checkpoint needs the full mode with checkpoint_dir= and at least one train_step; expected "
                f"a train state, found {'no checkpoint_dir' if self.checkpoints is None else 'no step yet'}"
            )
        self.checkpoints.maybe_save(full["count"], full["state"], data_state=self._data_state(), force=True)
        if wait:
            self.checkpoints.wait()
        return full["count"]

    def restore_checkpoint(self, step: int | None = None) -> int:
        """Restore the full mode's train state from ``checkpoint_dir`` (``step``, default the latest good one) onto
        this plan's shardings; later steps continue from it. Returns the step restored."""
        full = self._full
        if self.checkpoints is None or full is None:
            raise BridgeError(
                "restore_checkpoint needs the full mode with checkpoint_dir=: expected OptimizedDDP(module, "
                "optimizer=..., criterion=..., checkpoint_dir=...), found none"
            )
        if full["state"] is None:
            self._build_full(full)
        full["state"], data_state, _ = self.checkpoints.restore(abstract_train_state(full["state"]), step)
        if self._batches is not None and data_state is not None:  # the loader continues where that step stopped
            self._batches.set_state(data_state)
        full["hyper"] = None  # the next step writes param_groups' current values over the saved ones
        full["count"] = int(self.checkpoints.restored_step)  # type: ignore[arg-type]
        full["dirty"] = True
        return full["count"]

    def close(self) -> None:
        """Wait for the checkpoint saves in flight and close the `CheckpointManager`; training may go on without
        saving."""
        if self.checkpoints is not None:
            self.checkpoints.close()
            self.checkpoints = None

    def _next_key(self) -> jax.Array:
        self._key, key = jax.random.split(self._key)
        return key

    def _replicated_value(self, value: Any) -> jax.Array:
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, NamedSharding(self.mesh, P()), lambda index: value[index])

    @staticmethod
    def _like(t: torch.Tensor, old: jax.Array) -> jax.Array:
        """``t``'s value as an array of ``old``'s dtype and sharding (the same on every process, as DDP keeps it)."""
        value = t.detach().cpu().numpy().astype(old.dtype)
        return jax.make_array_from_callback(value.shape, old.sharding, lambda index: value[index])

    def _split(self, t: torch.Tensor) -> jax.Array:
        """This process's batch (dim 0), as its rows of the global batch over the data axis."""
        n = self.mesh.shape[self.data_axis] // jax.process_count()
        if t.ndim == 0 or t.shape[0] % n:
            raise BatchError(
                f"OptimizedDDP splits dim 0 of each input over this process's {n} devices; found shape "
                f"{tuple(t.shape)}. Give a batch that is a multiple of {n} (a DataLoader with drop_last=True), or "
                "train without microbatch=, or in the drop-in mode (model(x), loss.backward(), optimizer.step())"
            )
        value = t.detach().cpu().numpy()
        return jax.make_array_from_process_local_data(NamedSharding(self.mesh, self._rows), value)

    def _global_host(self, t: torch.Tensor) -> np.ndarray:
        """The global batch (every process's rows, in process order) on the host, from this process's ``t``."""
        if t.ndim == 0:
            raise BatchError(f"OptimizedDDP cuts dim 0 of each input into microbatches; found a 0-d tensor {t!r}")
        value = t.detach().cpu().numpy()
        return np.asarray(multihost_utils.process_allgather(value, tiled=True)) if jax.process_count() > 1 else value

    def _buffers_now(self) -> dict[str, torch.Tensor]:
        named = dict(self.module.named_buffers())
        return {n: named[n] for n in self._low.buffer_names}

    def _write_buffers(self, new: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, t in self._buffers_now().items():
                t.copy_(
                    device_tensor(new[n], t.device)
                    if jax.process_count() == 1
                    else torch.from_numpy(host_value(new[n]))
                )
