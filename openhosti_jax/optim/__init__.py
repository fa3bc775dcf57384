"""Optimizer-state sharding (ZeRO stages) for any optax transformation."""

from openhosti_jax.optim.zero import ZERO_AXES, opt_state_specs, zero_specs

__all__ = ["ZERO_AXES", "opt_state_specs", "zero_specs"]
