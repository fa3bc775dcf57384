"""The compiler settings the library gives a step's program on a GPU, as data: one `CompilerSetting` per option, each
citing where the value comes from, and `settings_for`, which sizes them from the model and leaves alone every one the
user has set.

The settings are those MaxText's H100 recipe ships (`MAXTEXT_1VM`: ``src/maxtext/configs/gpu/a3/llama_2_7b/1vm.sh``)
and JAX-Toolbox's GPU performance guide presents (`JAX_TOOLBOX`: ``docs/GPU_performance.md``): ``jax_optimization_level
O1`` (the guide's "modern switch": the latency-hiding scheduler, pipelined collectives and while-loop double buffering
in one), the same named explicitly as both sources name them, all-gather / reduce-scatter / all-reduce combine
thresholds of at least one layer's weights (the guide: "at least as large as the size of weights (AG) or gradients
(RS) in a single transformer layer"), collectives combined whatever their dimension, and XLA's own rematerialization
pass off (the plan's remat policy decides what is recomputed, and the memory the planner verified by compiling is the
program's). Option names are those jaxlib 0.10.2 takes (MaxText's later recipes spell the pipelining flags
``--xla_gpu_pipeline_all_gather=on``, which this XLA rejects; its February 2026 recipe has the names used here).

Left at XLA's defaults, where the sources disagree or the setting costs what a plan does not price: CUDA graphs
(``xla_gpu_enable_command_buffer``: MaxText turns them off, the guide recommends them and XLA has them on),
``xla_gpu_enable_highest_priority_async_stream`` (on by default: the guide lists it as no longer needed),
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (read when CUDA starts; the guide: faster on Hopper, slower on Blackwell) and
``NCCL_NVLS_ENABLE`` (extra device memory).

They are applied per compiled program, as `jax.jit`'s ``compiler_options``, which XLA applies over the flags its
backend started with: so they hold whether or not the backend has started, and a threshold can be sized from the
model the step trains. An option named in ``XLA_FLAGS``, or ``jax_optimization_level`` set in jax's config (or
``JAX_OPTIMIZATION_LEVEL``), is the user's: it is left out and the user's value holds. ``OPENHOSTI_GPU_SETTINGS=0``
(or ``spmd(..., compiler_settings=False)``) sets none. On CPU and TPU nothing is set.

Example:
    >>> s = settings_for("gpu", layer_bytes=2**30, xla_flags="--xla_gpu_enable_triton_gemm=true", opt_level="UNKNOWN")
    >>> s.options()["xla_gpu_all_gather_combine_threshold_bytes"]  # one layer's 1 GiB over MaxText's 128 MiB
    1073741824
    >>> "xla_gpu_enable_triton_gemm" in s.options(), s.user_kept
    (False, ('xla_gpu_enable_triton_gemm',))
    >>> settings_for("cpu", layer_bytes=2**30).options()
    {}
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping
from typing import Any, Literal

import jax
import numpy as np

from openhosti_jax.errors import ConfigError

MAXTEXT_1VM = (
    "https://github.com/AI-Hypercomputer/maxtext/blob/3532d6427dc53966219819c1404b8ee10a07d96f/"
    "src/maxtext/configs/gpu/a3/llama_2_7b/1vm.sh (Llama-2 7B on one A3 node of 8 H100)"
)
"""MaxText's single-node H100 recipe, at the commit read."""

JAX_TOOLBOX = (
    "https://github.com/NVIDIA/JAX-Toolbox/blob/0f87cf9208bc7734300c6b3d8a7c1e41ee7ab0d7/docs/GPU_performance.md"
)
"""JAX-Toolbox's "Tips for High-Performance LLMs with JAX and XLA", at the commit read."""

Kind = Literal["xla", "jax"]
"""``"xla"``: an XLA debug option (the name ``XLA_FLAGS`` takes, without ``--``); ``"jax"``: a jax config option
passed as the compile option of the same effect."""

SIZED = ("all_gather", "reduce_scatter", "all_reduce")
"""The collectives whose combine threshold is sized from one layer's bytes."""


@dataclasses.dataclass(frozen=True)
class CompilerSetting:
    """One compiler option set on a GPU step."""

    name: str
    """The option: an XLA debug option as ``XLA_FLAGS`` names it (without ``--``), or a jax config name."""
    value: bool | int | str
    """The value set."""
    source: str
    """Where the value comes from (a recipe or guide, at the commit read)."""
    why: str
    """What it does for a training step."""
    kind: Kind = "xla"
    """Which namespace ``name`` is in."""

    def __post_init__(self) -> None:
        if self.kind not in ("xla", "jax"):
            raise ConfigError(f"CompilerSetting.kind: expected 'xla' or 'jax', found {self.kind!r}")
        if not isinstance(self.value, bool | int | str):
            raise ConfigError(f"CompilerSetting {self.name}: expected a bool, int or str value, found {self.value!r}")

    def flag(self) -> str:
        """The setting as ``XLA_FLAGS`` (or, for a jax option, jax's config) spells it.

        >>> GPU_SETTINGS[1].flag()
        '--xla_gpu_enable_latency_hiding_scheduler=true'
        """
        value = str(self.value).lower() if isinstance(self.value, bool) else self.value
        return f"{self.name}={value}" if self.kind == "jax" else f"--{self.name}={value}"

    def option(self) -> tuple[str, Any]:
        """``(key, value)`` as `jax.jit`'s ``compiler_options`` takes it."""
        if self.kind == "jax" and self.name == "jax_optimization_level":
            from jax._src.config import EffortLevel  # the enum jax itself converts the config value with

            return "optimization_level", EffortLevel[str(self.value)].value
        return self.name, self.value


_COMBINE = "combine a layer's collectives into one message, which reaches a higher link bandwidth than many small ones"

GPU_SETTINGS: tuple[CompilerSetting, ...] = (
    CompilerSetting(
        "jax_optimization_level",
        "O1",
        JAX_TOOLBOX + ' ("Optimization level")',
        "the latency-hiding scheduler, pipelined collectives and while-loop double buffering as one level",
        kind="jax",
    ),
    CompilerSetting(
        "xla_gpu_enable_latency_hiding_scheduler",
        True,
        f"{MAXTEXT_1VM}; {JAX_TOOLBOX}",
        "schedule collectives early so they run beside compute",
    ),
    *(
        CompilerSetting(
            f"xla_gpu_enable_pipelined_{c}",
            True,
            f"{MAXTEXT_1VM}; {JAX_TOOLBOX}",
            f"start a scanned layer's {c.replace('_', '-')} in the previous iteration",
        )
        for c in SIZED
    ),
    CompilerSetting(
        "xla_gpu_enable_while_loop_double_buffering",
        True,
        f"{MAXTEXT_1VM}; {JAX_TOOLBOX}",
        "unroll the layers' loop twice so one iteration's collectives overlap the other's compute",
    ),
    *(
        CompilerSetting(f"xla_gpu_{c}_combine_threshold_bytes", floor, f"{MAXTEXT_1VM}; {JAX_TOOLBOX}", _COMBINE)
        for c, floor in zip(SIZED, (134217728, 67108864, 134217728), strict=True)
    ),
    *(
        CompilerSetting(
            f"xla_gpu_enable_{c}_combine_by_dim",
            False,
            MAXTEXT_1VM,
            f"combine {c.replace('_', '-')}s of different dimensions too",
        )
        for c in ("all_gather", "reduce_scatter")
    ),
    CompilerSetting(
        "xla_disable_hlo_passes",
        "rematerialization",
        MAXTEXT_1VM,
        "the plan's remat policy decides what is recomputed; the memory the planner verified is the program's",
    ),
    CompilerSetting("xla_gpu_enable_triton_gemm", False, MAXTEXT_1VM, "matmuls by cuBLAS rather than Triton's GEMMs"),
)
"""The settings at the recipes' values, before sizing (`settings_for`)."""


@dataclasses.dataclass(frozen=True)
class AppliedSettings:
    """What `settings_for` decided for one step."""

    platform: str
    """The platform the step compiles for."""
    applied: tuple[CompilerSetting, ...] = ()
    """The settings given to the step's compile."""
    user_kept: tuple[str, ...] = ()
    """Settings the user set (``XLA_FLAGS``, jax's config), left as the user set them."""
    layer_bytes: int | None = None
    """One layer's parameter bytes the combine thresholds were sized from (None: no repeated layer found)."""
    reason: str = ""
    """Why nothing is set, where nothing is."""

    def options(self) -> dict[str, Any]:
        """`jax.jit`'s ``compiler_options`` for the step."""
        return dict(s.option() for s in self.applied)

    def describe(self) -> str:
        """One line for a report."""
        if not self.applied:
            return f"compiler settings: none set ({self.reason})"
        sized = f"; combine thresholds sized from one layer's {self.layer_bytes} bytes" if self.layer_bytes else ""
        kept = f"; left as the user set them: {', '.join(self.user_kept)}" if self.user_kept else ""
        return (
            f"compiler settings for {self.platform} (MaxText's and JAX-Toolbox's; OPENHOSTI_GPU_SETTINGS=0 turns them "
            f"off): {' '.join(s.flag() for s in self.applied)}{sized}{kept}"
        )


def user_xla_flags(xla_flags: str | None = None) -> dict[str, str]:
    """The options named in ``xla_flags`` (default: ``$XLA_FLAGS``), name -> value as written (``"true"`` for a
    bare ``--flag``).

    >>> user_xla_flags("--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d --xla_foo")
    {'xla_gpu_enable_latency_hiding_scheduler': 'false', 'xla_dump_to': '/tmp/d', 'xla_foo': 'true'}
    """
    text = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    try:
        tokens = shlex.split(text)
    except ValueError:  # an unbalanced quote: read it as the backend does, split on whitespace
        tokens = text.split()
    out = {}
    for token in tokens:
        if token.startswith("--"):
            name, _, value = token[2:].partition("=")
            out[name] = value if _ else "true"
    return out


def enabled_by_env() -> bool:
    """Whether ``OPENHOSTI_GPU_SETTINGS`` leaves the settings on (anything but ``0``, ``false``, ``off``)."""
    return os.environ.get("OPENHOSTI_GPU_SETTINGS", "1").strip().lower() not in ("0", "false", "off", "no")


def settings_for(
    platform: str,
    layer_bytes: int | None = None,
    *,
    enabled: bool = True,
    xla_flags: str | None = None,
    opt_level: str | None = None,
) -> AppliedSettings:
    """The settings for a step compiled for ``platform`` (``"gpu"``: `GPU_SETTINGS`, each combine threshold raised to
    ``layer_bytes``, one layer's parameter bytes, where that is larger; any other platform: none). ``xla_flags``
    (default ``$XLA_FLAGS``) and ``opt_level`` (default: jax's ``jax_optimization_level``) are the user's: an option
    they name is left out. ``enabled=False`` or ``OPENHOSTI_GPU_SETTINGS=0``: none."""
    if platform != "gpu":
        return AppliedSettings(platform, reason=f"{platform} backend: the GPU settings apply on GPUs only")
    if not enabled or not enabled_by_env():
        why = "compiler_settings=False" if not enabled else "OPENHOSTI_GPU_SETTINGS=0"
        return AppliedSettings(platform, reason=f"turned off by {why}")
    user = user_xla_flags(xla_flags)
    level = jax.config.jax_optimization_level if opt_level is None else opt_level
    applied, kept = [], []
    for s in GPU_SETTINGS:
        if (s.kind == "xla" and s.name in user) or (s.kind == "jax" and level != "UNKNOWN"):
            kept.append(s.name)
            continue
        if layer_bytes and s.name.endswith("_combine_threshold_bytes") and layer_bytes > int(s.value):
            s = dataclasses.replace(s, value=int(layer_bytes), why=f"{s.why}: one layer's bytes")
        applied.append(s)
    return AppliedSettings(platform, tuple(applied), tuple(kept), layer_bytes)


def _nbytes(leaf: Any) -> int:
    shape, dtype = np.shape(leaf), getattr(leaf, "dtype", None)
    return int(np.prod(shape)) * np.dtype(dtype).itemsize if dtype is not None else 0


def _key(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def layer_bytes(params: Any) -> int | None:
    """The bytes of the largest repeated layer of ``params``: a member of a list of blocks (a path entry that is an
    index, whose siblings are more than one), or a stack of blocks (a subtree of several leaves that all lead with
    the same length ``L > 1``: its bytes over ``L``); None when there is neither.

    >>> import jax.numpy as jnp
    >>> layer_bytes({"blocks": [{"w": jnp.zeros((4, 4))}] * 3, "head": jnp.zeros((4, 100))})
    64
    >>> layer_bytes({"blocks": {"w": jnp.zeros((3, 4, 4)), "b": jnp.zeros((3, 4))}, "head": jnp.zeros((4, 100))})
    80
    """
    leaves = [(tuple(_key(k) for k in path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
    best = 0
    listed: dict[tuple, dict[int, int]] = {}
    for path, leaf in leaves:
        for i, k in enumerate(path):
            if isinstance(k, int) and not isinstance(k, bool):
                members = listed.setdefault(path[:i], {})
                members[k] = members.get(k, 0) + _nbytes(leaf)
                break
    for members in listed.values():
        if len(members) > 1:
            best = max(best, max(members.values()))
    prefixes = {path[:i] for path, _ in leaves for i in range(1, len(path))}
    for prefix in prefixes:
        under = [leaf for path, leaf in leaves if path[: len(prefix)] == prefix]
        leads = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in under}
        if len(under) > 1 and len(leads) == 1 and (n := leads.pop()) is not None and n > 1:
            best = max(best, sum(_nbytes(leaf) for leaf in under) // n)
    return best or None


def step_settings(
    mesh: jax.sharding.Mesh,
    params: Any,
    enabled: bool = True,
    overrides: Mapping[str, str] | None = None,
    platform: str | None = None,
) -> AppliedSettings:
    """`settings_for` the platform of ``mesh``'s devices (or ``platform``), sized from the parameters ``params``
    (arrays or `jax.ShapeDtypeStruct`); ``overrides``: ``{"xla_flags": ..., "opt_level": ...}`` in place of the
    process's."""
    platform = platform or str(mesh.devices.flat[0].platform)
    sized = layer_bytes(params) if platform == "gpu" else None
    return settings_for(platform, sized, enabled=enabled, **dict(overrides or {}))


__all__ = [
    "AppliedSettings",
    "CompilerSetting",
    "GPU_SETTINGS",
    "layer_bytes",
    "settings_for",
    "step_settings",
    "user_xla_flags",
]
