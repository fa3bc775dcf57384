"""Dynamic load balancing: slow devices and hosts get fewer microbatches; the gradient stays exact."""

from openhosti_jax.balance.balancer import Balancer
from openhosti_jax.balance.buffer import pack_microbatches, place_microbatches
from openhosti_jax.balance.grad import BalancedGradFn, make_balanced_grad_fn
from openhosti_jax.balance.hostdata import HostLocalBatch, HostLocalData
from openhosti_jax.balance.monitor import Monitor
from openhosti_jax.balance.rebalancer import Rebalancer, describe_assignment
from openhosti_jax.balance.throttle import Throttle

__all__ = [
    "BalancedGradFn",
    "Balancer",
    "HostLocalBatch",
    "HostLocalData",
    "Monitor",
    "Rebalancer",
    "Throttle",
    "describe_assignment",
    "make_balanced_grad_fn",
    "pack_microbatches",
    "place_microbatches",
]
