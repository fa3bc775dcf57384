"""Dynamic load balancing: slow devices and hosts get fewer microbatches; the gradient stays exact."""

from openhosti_jax.balance.buffer import pack_microbatches, place_microbatches
from openhosti_jax.balance.step import BalancedGradFn, make_balanced_grad_fn
from openhosti_jax.balance.throttle import Throttle

__all__ = ["BalancedGradFn", "Throttle", "make_balanced_grad_fn", "pack_microbatches", "place_microbatches"]
