"""`MeshConfig`: the named axes of the device mesh and how their sizes are resolved.

Example:
    >>> from openhosti_jax.mesh import MeshConfig
    >>> MeshConfig(data=-1, fsdp=2).resolve(8)
    {'stage': 1, 'data': 4, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 1}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from openhosti_jax.errors import MeshConfigError

AXES: tuple[str, ...] = ("stage", "data", "fsdp", "expert", "context", "tensor")
"""Mesh axis names, outermost (slowest links) first."""

BATCH_AXES: tuple[str, ...] = ("data", "fsdp")
"""Axes the global batch is split over (FSDP shards the batch too, as in ZeRO-3)."""

EXPERT_AXIS = "expert"
"""The axis a mixture-of-experts layer's routed experts are split over (`openhosti_jax.models.moe`); outside those
layers it splits the batch's rows like ``data``."""

TOKEN_AXES: tuple[str, ...] = (*BATCH_AXES, EXPERT_AXIS)
"""Every axis a batch's rows may be split over: `BATCH_AXES`, and ``expert`` where it is larger than 1."""

SEQUENCE_AXIS = "context"
"""The axis a batch's sequence dim (its second) is split over: context parallelism (`openhosti_jax.models.context`)."""

Size = int | Literal["auto"]


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; their product must equal the device count.

    A size of ``-1`` is inferred from the device count (at most one axis may be ``-1``); ``"auto"`` leaves the
    choice to the planner (`openhosti_jax.plan`), and `resolve` treats it as ``-1``.
    """

    stage: Size = 1
    """Pipeline stages (`openhosti_jax.pipeline`)."""
    data: Size = -1
    """Data-parallel replicas (parameters replicated, batch split)."""
    fsdp: Size = 1
    """Fully-sharded data parallel: batch split, parameters / optimizer state sharded."""
    expert: Size = 1
    """Expert parallel: a mixture-of-experts layer's routed experts split over it, tokens sent to their experts by
    all-to-all; every other layer treats it as a data axis (batch split, ZeRO shards state over it)."""
    context: Size = 1
    """Context parallel: every sequence split along its length (attention passes keys and values between the
    shards, `openhosti_jax.models.context`); parameters replicated over it, gradients reduced over it."""
    tensor: Size = 1
    """Tensor (model) parallel: attention heads / MLP hidden dims split."""
    dcn: dict[str, int] = field(default_factory=dict)
    """Multi-slice / multi-host factor per axis (e.g. ``{"data": 2}`` for 2 hosts); ICI size = size / dcn."""
    axis_type: Literal["auto", "explicit"] = "auto"
    """`jax.sharding.AxisType` of every axis. ``auto`` lets XLA propagate shardings through any user model."""

    def __post_init__(self) -> None:
        problems = []
        for name in AXES:
            v = getattr(self, name)
            if not (v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1))):
                problems.append(f"{name}={v!r} (expected a positive int, -1 to infer, or 'auto')")
        inferred = [n for n in AXES if getattr(self, n) == -1]
        if len(inferred) > 1:
            problems.append(f"more than one axis set to -1 ({inferred}); give all but one a size")
        for k, v in self.dcn.items():
            if k not in AXES:
                problems.append(f"dcn axis {k!r} is not one of {AXES}")
            elif not isinstance(v, int) or v < 1:
                problems.append(f"dcn[{k!r}]={v!r} (expected a positive int)")
        if self.axis_type not in ("auto", "explicit"):
            problems.append(f"axis_type={self.axis_type!r} (expected 'auto' or 'explicit')")
        if problems:
            raise MeshConfigError("invalid MeshConfig: " + "; ".join(problems))

    def resolve(self, device_count: int) -> dict[str, int]:
        """Concrete axis sizes for ``device_count`` devices, inferring the (single) ``-1`` / ``"auto"`` axis.

        Several ``"auto"`` axes cannot be resolved here: use the planner.
        """
        open_axes = [n for n in AXES if getattr(self, n) in (-1, "auto")]
        fixed = {n: getattr(self, n) for n in AXES if n not in open_axes}
        known = math.prod(fixed.values())
        if len(open_axes) > 1:
            raise MeshConfigError(
                f"cannot resolve {open_axes} without the planner; expected at most one open axis, found "
                f"{len(open_axes)}. Give sizes, or call openhosti_jax.plan(...) to choose them."
            )
        if open_axes:
            if device_count % known:
                raise MeshConfigError(
                    f"fixed axes {fixed} multiply to {known}, which does not divide the {device_count} devices; "
                    f"choose sizes whose product divides {device_count}"
                )
            fixed[open_axes[0]] = device_count // known
        elif known != device_count:
            raise MeshConfigError(
                f"mesh axes {fixed} multiply to {known} but there are {device_count} devices; make the product "
                f"equal {device_count} or set one axis to -1"
            )
        sizes = {n: fixed[n] for n in AXES}
        for k, v in self.dcn.items():
            if sizes[k] % v:
                raise MeshConfigError(f"dcn[{k!r}]={v} does not divide the {k} axis size {sizes[k]}; pick a divisor")
        return sizes

    @staticmethod
    def from_sizes(sizes: dict[str, int], **kw) -> MeshConfig:
        """A config with exactly these sizes (missing axes are 1)."""
        unknown = set(sizes) - set(AXES)
        if unknown:
            raise MeshConfigError(f"unknown mesh axes {sorted(unknown)}; expected names from {AXES}")
        return MeshConfig(**{n: sizes.get(n, 1) for n in AXES}, **kw)
