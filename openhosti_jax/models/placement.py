"""Where the bundled models place their activations under a plan: the token embedding looked up from a table
gathered for the use, the lookup's result and the logits split over the batch as the plan's batch spec says
(`openhosti_jax.state.context.active_activation_sharding`). Outside a planned step nothing is placed.

Left to itself XLA's partitioner may keep a ZeRO-3 weight split and move activations instead: compiling Llama-3 8B
for 64 TPU v5p chips (fsdp=64, one sequence per chip), its embedding table split along the vocabulary made every
chip look up every token of the global batch (``bf16[64,1024,4096]`` per chip) and its output head gathered the
whole batch's activations; placed, each chip looks up and scores its own sequence.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> e = nnx.Embed(16, 4, rngs=nnx.Rngs(0))
    >>> tokens = jnp.array([[1, 2, 3]])
    >>> bool(jnp.array_equal(lookup(e, tokens), e(tokens)))  # outside a planned step: nnx.Embed's lookup
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from openhosti_jax.state.context import constrain_activation, constrain_logits, gathered, vocab_axis

__all__ = ["constrain_activation", "constrain_logits", "lookup"]


def lookup(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """``embed(tokens)``, its table gathered over the batch axes before the lookup (split over ``tensor`` along the
    vocabulary where the plan has a tensor axis: Megatron's vocabulary-parallel embedding) and the result placed
    over the batch (`constrain_activation`)."""
    table = embed.embedding[...]
    if embed.dtype is not None:
        table = table.astype(embed.dtype)
    axis = vocab_axis()
    table = gathered(table, (axis, None) if axis else None)
    return constrain_activation(jnp.take(table, tokens, axis=0))
