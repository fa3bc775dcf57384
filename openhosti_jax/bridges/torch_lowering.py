"""A torch ``nn.Module`` as a pure JAX function, through torchax (pinned: ``torchax==0.0.13``), isolated here.

torchax 0.0.13 names aten overloads of named tensors (``aten.prod.dim_Dimname``, ``aten.norm.names_ScalarOpt_dim``,
...) when it is imported and when its operator table is built; torch 2.13 removed them, so the import fails.
`import_torchax` lets exactly those names resolve to inert placeholders while torchax loads (no model can call a
removed overload), and puts back the torch global that the import changes (the MultiheadAttention fast path).

`lower` gives ``apply(params, buffers, *args, key=None) -> (output, buffers)``, jittable and differentiable, and
``call`` for any call structure (keyword arguments, non-tensor arguments, outputs that are dicts, dataclasses or
transformers' ``ModelOutput``: `openhosti_jax.bridges.torch_tree`); parameters shared by two modules (a tied
embedding and head) are one entry. The forward is traced with ``torch.compiler.is_compiling()`` true, as under
``torch.compile(fullgraph=True)``: code with a compile-friendly path (transformers' attention masks) takes it; reading
a traced value in Python (``.item()``, ``if tensor:``) is a `BridgeError` naming the module and the source line.
Batch norm writes its running statistics into the returned buffers as torch does (torchax's own drops them).

Example:
    >>> import torch, jax.numpy as jnp
    >>> lin = torch.nn.Linear(3, 2)
    >>> low = lower(lin)
    >>> out, _ = low.apply(low.params(), low.buffers(), jnp.ones((4, 3)))
    >>> bool(jnp.allclose(out, lin(torch.ones(4, 3)).detach().numpy(), atol=1e-6))
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from openhosti_jax.bridges.torch_tree import flatten, unflatten
from openhosti_jax.errors import BridgeError


class _Removed:
    """Stands for an aten overload torch no longer has (hashable, never called)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<aten overload removed from torch: {self.name}>"


def _named_tensor_overload(key: str) -> bool:
    return "imname" in key.lower() or "names" in key


@functools.cache
def import_torchax() -> Any:
    """torchax, imported (once) with the named-tensor overloads torch 2.13 removed standing in as placeholders."""
    import torch
    from torch._ops import OpOverloadPacket

    original = OpOverloadPacket.__getattr__

    def lenient(self: Any, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if _named_tensor_overload(key):
                return _Removed(f"{self._qualified_op_name}.{key}")
            raise

    fast_path = torch.backends.mha.get_fastpath_enabled()
    OpOverloadPacket.__getattr__ = lenient
    try:
        import torchax
        import torchax.decompositions  # noqa: F401  (built lazily otherwise, outside this guard)

        _batch_norm_writes_running_stats(torchax.default_env())  # builds its operator table, then corrects it
    except ImportError as e:
        raise BridgeError(
            f"torchax is needed to run a torch module on JAX ({e}); install the extra: "
            "pip install 'openhosti_jax[torch]'"
        ) from e
    finally:
        OpOverloadPacket.__getattr__ = original
        torch.backends.mha.set_fastpath_enabled(fast_path)
    return torchax


def _batch_norm_writes_running_stats(env: Any) -> None:
    """torchax's batch norm computes the running statistics and drops them; torch writes them into the module's
    buffers (the variance unbiased). This one does as torch does, on torchax tensors."""
    import torch

    def batch_norm(
        x: Any, weight: Any, bias: Any, mean_run: Any, var_run: Any, training: bool, momentum: float, eps: float
    ) -> tuple[Any, Any, Any]:
        dims, shape = [0, *range(2, x.ndim)], [1, -1] + [1] * (x.ndim - 2)
        if training:
            mean = x.mean(dims)
            var = ((x - mean.reshape(shape)) ** 2).mean(dims)
            n = x.numel() // x.shape[1]
            if mean_run is not None and var_run is not None:
                with torch.no_grad():
                    mean_run.copy_((1 - momentum) * mean_run + momentum * mean.detach())
                    var_run.copy_((1 - momentum) * var_run + momentum * var.detach() * n / max(n - 1, 1))
        else:
            mean, var = mean_run, var_run
        rstd = torch.rsqrt(var + eps)
        out = (x - mean.reshape(shape)) * rstd.reshape(shape)
        if weight is not None:
            out = out * weight.reshape(shape)
        if bias is not None:
            out = out + bias.reshape(shape)
        return out, mean, rstd

    def no_training(x: Any, weight: Any, bias: Any, mean_run: Any, var_run: Any, momentum: float, eps: float) -> Any:
        return batch_norm(x, weight, bias, mean_run, var_run, False, momentum, eps)

    aten = torch.ops.aten
    env.override_op_definition(aten._native_batch_norm_legit.default, batch_norm)
    env.override_op_definition(aten.native_batch_norm.default, batch_norm)
    env.override_op_definition(aten._native_batch_norm_legit_no_training.default, no_training)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A torch module as JAX: its parameter and buffer names, and ``apply``."""

    module: Any
    param_names: tuple[str, ...]
    """Names of the distinct parameters (a tied one once, by its first name)."""
    buffer_names: tuple[str, ...]
    apply: Callable[..., tuple[Any, dict[str, Any]]]
    """``apply(params, buffers, *args, key=None) -> (output, buffers after the call)``, pure; ``key`` draws the
    random numbers (dropout) with JAX's generator, not torch's."""
    call: Callable[..., tuple[list[Any], Any, dict[str, Any]]]
    """``call(params, buffers, spec, leaves, key=None) -> (output leaves, output spec, buffers after the call)``:
    the forward of ``unflatten(spec, leaves) == (args, kwargs)`` (`openhosti_jax.bridges.torch_tree`), pure."""

    def params(self) -> dict[str, jax.Array]:
        """The module's current parameter values as JAX arrays."""
        named = dict(self.module.named_parameters())
        return {n: jax.numpy.asarray(_numpy(named[n])) for n in self.param_names}

    def buffers(self) -> dict[str, jax.Array]:
        """The module's current buffer values as JAX arrays."""
        named = dict(self.module.named_buffers())
        return {n: jax.numpy.asarray(_numpy(named[n])) for n in self.buffer_names}


def _numpy(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy()


def lower(module: Any) -> Lowered:
    """``module``'s forward as a pure JAX function of its parameters, buffers and arguments."""
    torchax = import_torchax()
    from torchax.interop import JittableModule

    jm = JittableModule(module, dedup_parameters=True)
    env = torchax.default_env()
    names = tuple(jm.params)
    buffer_names = tuple(jm.buffers)

    def apply(
        params: dict[str, Any], buffers: dict[str, Any], *args: Any, key: jax.Array | None = None
    ) -> tuple[Any, dict[str, Any]]:
        p, b, a = env.j2t_iso((dict(params), dict(buffers), args))
        with env, env.override_property(prng=key) if key is not None else contextlib.nullcontext():
            out = _explained(module, lambda: jm.functional_call("forward", p, b, *a))
        return env.t2j_iso(out), env.t2j_iso(b)

    def call(
        params: dict[str, Any], buffers: dict[str, Any], spec: Any, leaves: list[Any], key: jax.Array | None = None
    ) -> tuple[list[Any], Any, dict[str, Any]]:
        p, b, lv = env.j2t_iso((dict(params), dict(buffers), list(leaves)))
        args, kwargs = unflatten(spec, lv)
        with env, env.override_property(prng=key) if key is not None else contextlib.nullcontext():
            out = _explained(module, lambda: jm.functional_call("forward", p, b, *args, **kwargs))
        out_leaves, out_spec = flatten(out)
        return env.t2j_iso(out_leaves), out_spec, env.t2j_iso(b)

    return Lowered(module, names, buffer_names, apply, call)


def lower_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A torch function of tensors (a loss) as a JAX function of arrays."""
    env = import_torchax().default_env()

    def lowered(*args: Any) -> Any:
        a = env.j2t_iso(args)
        with env:
            out = _explained(None, lambda: fn(*a))
        return env.t2j_iso(out)

    return lowered


def _explained(module: Any, call: Callable[[], Any]) -> Any:
    """``call()``, with torchax's failures turned into errors that name the op, the module path and the fix."""
    import torch
    from torchax.tensor import OperatorNotFound

    names = {id(m): n or type(m).__name__ for n, m in module.named_modules()} if module is not None else {}
    stack: list[str] = [type(module).__name__] if module is not None else []  # its own forward is called directly

    def enter(m: Any, _: Any) -> None:
        stack.append(names.get(id(m), type(m).__name__))

    def leave(m: Any, _: Any, __: Any) -> None:
        if len(stack) > 1:
            stack.pop()

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave),
    ]
    compiling = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True  # the trace is one graph, as torch.compile(fullgraph=True) makes
    try:
        return call()
    except (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerIntegerConversionError,
        jax.errors.TracerArrayConversionError,
    ) as e:
        where = f" in module {stack[-1]!r}" if stack else ""
        raise BridgeError(
            f"forward(){where} reads a tensor's value in Python at {_user_line(e)} (aten._local_scalar_dense: "
            "`.item()`, `if tensor:`, `int(tensor)`, `.numpy()`), which one compiled program cannot do: the value "
            "exists only when it runs. Keep the choice in tensors (torch.where, masking), or make it from non-tensor "
            "arguments"
        ) from e
    except OperatorNotFound as e:
        where = f" in module {stack[-1]!r}" if stack else ""
        raise BridgeError(
            f"{e}{where}: torchax 0.0.13 cannot run it on JAX. Write that step with other torch ops, or register a "
            "lowering: import_torchax().default_env().override_op_definition(op, impl)"
        ) from e
    except AssertionError as e:
        if "mixed math" not in str(e):
            raise
        where = f" in module {stack[-1]!r}" if stack else ""
        raise BridgeError(
            f"a tensor made in forward(){where} lives on torch's CPU device while the module runs on JAX; create "
            "it like its inputs (torch.ones(..., device=x.device), torch.zeros_like(x)) or register it as a buffer"
        ) from e
    finally:
        torch.compiler._is_compiling_flag = compiling
        for h in hooks:
            h.remove()


def _user_line(e: BaseException) -> str:
    """``file:line`` of the innermost frame of ``e``'s traceback outside torch, torchax, jax and this library."""
    import traceback

    skip = ("/torch/", "/torchax/", "/jax/", "/jaxlib/", "/openhosti_jax/bridges/")
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not any(s in f.filename for s in skip)]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else "an unknown line"
