"""A cluster the planner prices, attached or not: hosts x devices per host of one device profile.

The mesh is laid out as `openhosti_jax.mesh.build_mesh` lays it out with ``dcn`` factors (as MaxText's ``ici_*`` /
``dcn_*``): axes in `openhosti_jax.mesh.AXES` order, the innermost ones filling a host first, so that an axis's
size is its ICI (inside a host) factor times its DCN (across hosts) factor. A collective over a group of axes runs
hierarchically: within each host over the ICI factor (NVLink, ICI), then across hosts over the DCN factor (InfiniBand,
DCN) on the share each device holds, at the profile's ``dcn_bandwidth``; each step at the fraction of its link that
the profile's measured curve gives for its message size (`DeviceProfile.link_efficiency`, ``dcn_efficiency``).

Example:
    >>> c = cluster("64xH100")
    >>> c.hosts, c.devices_per_host, c.n_devices
    (8, 8, 64)
    >>> c.factors({"stage": 1, "data": 8, "fsdp": 8, "tensor": 1})  # (ICI, DCN) per axis: data spans the hosts
    {'stage': (1, 1), 'data': (1, 8), 'fsdp': (8, 1), 'expert': (1, 1), 'context': (1, 1), 'tensor': (1, 1)}
    >>> cluster("v5p-128").n_devices  # 128 TensorCores: 64 chips, one ICI domain
    64
    >>> c = cluster("2xv5p-128")  # multislice: two slices joined by DCN
    >>> c.hosts, c.devices_per_host
    (2, 64)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence

from openhosti_jax.errors import MeshConfigError, PlanningError
from openhosti_jax.mesh.config import AXES
from openhosti_jax.mesh.topology import TpuTarget, is_tpu_target, tpu_target
from openhosti_jax.planner.profiles import PROFILES, DeviceProfile, all_to_all_seconds, bus_bytes, curve_seconds
from openhosti_jax.planner.stacks import STACKS, Stack

MAX_DEVICES = 1 << 24
"""The most devices a `Cluster` may have (16,777,216: far past any cluster built; the search loops over divisors)."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``hosts`` hosts of ``devices_per_host`` devices described by ``profile``."""

    profile: DeviceProfile
    hosts: int = 1
    devices_per_host: int = 1
    stack: Stack = STACKS["openhosti"]
    """The software that runs the step (`openhosti_jax.planner.stacks`): this library's by default."""
    _prices: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise PlanningError(
                f"a cluster needs hosts >= 1 and devices_per_host >= 1; found {self.hosts} x {self.devices_per_host}"
            )
        if self.hosts * self.devices_per_host > MAX_DEVICES:
            raise PlanningError(
                f"expected a cluster of at most {MAX_DEVICES:,} devices, found {self.hosts:,} x "
                f"{self.devices_per_host:,}; the planner searches meshes over the device count's divisors"
            )

    @property
    def n_devices(self) -> int:
        """Devices in the cluster."""
        return self.hosts * self.devices_per_host

    def factors(self, mesh_shape: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """Axis -> (ICI factor, DCN factor): the innermost axes fill a host first."""
        return dict(_factors(self.devices_per_host, tuple(int(mesh_shape.get(a, 1)) for a in AXES)))

    def collective_seconds(self, kind: str, nbytes: float, mesh_shape: Mapping[str, int], axes: Sequence[str]) -> float:
        """Seconds of one collective of ``kind`` on a full buffer of ``nbytes`` over the groups spanning ``axes``:
        inside each host (the profile's link model at this message size, `DeviceProfile.link_seconds`), then across
        hosts on each device's share (remembered: a search prices the same collectives many times)."""
        key = (kind, nbytes, tuple(int(mesh_shape.get(a, 1)) for a in AXES), tuple(axes))
        if key not in self._prices:
            if len(self._prices) >= 2**16:
                self._prices.clear()
            self._prices[key] = self._price(kind, nbytes, mesh_shape, axes)
        return self._prices[key]

    def _price(self, kind: str, nbytes: float, mesh_shape: Mapping[str, int], axes: Sequence[str]) -> float:
        f = self.factors(mesh_shape)
        within = math.prod(f[a][0] for a in axes)
        across = math.prod(f[a][1] for a in axes)
        if kind == "all_to_all":
            return self._all_to_all(nbytes, within, across)
        local = self.profile.link_seconds
        if across == 1:
            return local(kind, nbytes, within)
        share = nbytes / within  # each device's part of the buffer after the in-host step
        remote = self.dcn_seconds(kind, share, across)
        if kind == "all_reduce":  # reduce-scatter in the host, all-reduce across, all-gather in the host
            return local("reduce_scatter", nbytes, within) + remote + local("all_gather", nbytes, within)
        return remote + local(kind, nbytes, within)

    def _all_to_all(self, nbytes: float, within: int, across: int) -> float:
        """An all-to-all over ``within`` devices in each of ``across`` hosts, each device holding ``nbytes``: the
        ``(across - 1) / across`` of it bound for other hosts leaves over the device's share of the network while
        the rest is exchanged in the host (`all_to_all_seconds` on ``nbytes / across``), at once: the longer of the
        two (together they move ``(n - 1) / n x nbytes``, n = within x across)."""
        local = all_to_all_seconds(self.profile, nbytes / across, within)
        return max(local, self.dcn_seconds("all_to_all", nbytes, across))

    def dcn_seconds(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds of a collective over ``n`` hosts on ``nbytes`` per device, each device on its own share of the
        host's network (`DeviceProfile.dcn_bandwidth`): at the measured fraction of it for ``nbytes``
        (`DeviceProfile.dcn_efficiency`), else with one latency per doubling of the host count."""
        p = self.profile
        if n <= 1 or nbytes <= 0:
            return 0.0
        if p.dcn_efficiency:
            return curve_seconds(p.dcn_efficiency, bus_bytes(kind, 1.0, n), nbytes, p.dcn_bandwidth)
        return p.dcn_latency * math.ceil(math.log2(n)) + bus_bytes(kind, nbytes, n) / p.dcn_bandwidth


@functools.lru_cache(maxsize=4096)
def _factors(per_host: int, sizes: tuple[int, ...]) -> tuple[tuple[str, tuple[int, int]], ...]:
    room, out = per_host, {}
    for axis, n in reversed(list(zip(AXES, sizes, strict=True))):
        ici = math.gcd(n, room)
        room //= ici
        out[axis] = (ici, n // ici)
    return tuple((a, out[a]) for a in AXES)


def cluster(spec: str | Cluster | TpuTarget, profiles: Mapping[str, DeviceProfile] = PROFILES) -> Cluster:
    """A `Cluster` from ``"NxKIND"`` (``"8xH100"``: N devices, in hosts of the profile's ``devices_per_host``),
    ``"HxDxKIND"`` (``"2x8xH100"``: H hosts of D) or a TPU slice name (``"v5p-128"``, ``"v4-64"``: TensorCores;
    ``"v5e-256"``, ``"v6e-64"``: chips), optionally several slices (``"2xv5p-128"``). A TPU slice is one ICI
    domain, its own "host" here: only slices talk over DCN (MaxText's ``dcn_*`` axes span slices)."""
    if isinstance(spec, Cluster):
        return spec
    names = {k.lower().replace(" ", ""): k for k in profiles}
    if isinstance(spec, TpuTarget) or is_tpu_target(spec):
        try:
            t = tpu_target(spec)
        except MeshConfigError as e:
            raise PlanningError(str(e)) from e
        return Cluster(profiles[t.profile_name], t.slices, t.chips)
    gpu = re.fullmatch(r"(?:([0-9]{1,12})x)?([0-9]{1,12})x([A-Za-z0-9 ]+)", spec.strip())
    if gpu and gpu[3].lower().replace(" ", "") in names:
        profile = profiles[names[gpu[3].lower().replace(" ", "")]]
        if gpu[1]:
            return Cluster(profile, int(gpu[1]), int(gpu[2]))
        chips = int(gpu[2])
        if not 1 <= chips <= MAX_DEVICES:
            raise PlanningError(f"{spec!r}: expected 1..{MAX_DEVICES:,} devices, found {chips:,}")
    else:
        raise PlanningError(
            f"unknown cluster {spec!r}: expected 'NxKIND' (e.g. '64xH100'), 'HOSTSxPER_HOSTxKIND' (e.g. '8x8xH100') "
            f"or a TPU slice ('v5p-128', 'v5e-256'), KIND one of {sorted(profiles)}"
        )
    per_host = min(profile.devices_per_host, chips)
    if chips % per_host:
        raise PlanningError(
            f"{spec!r}: {chips} devices do not fill hosts of {per_host}; use a multiple of {per_host} devices"
        )
    return Cluster(profile, chips // per_host, per_host)
