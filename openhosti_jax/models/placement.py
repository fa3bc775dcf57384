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
from jax.sharding import PartitionSpec as P

from openhosti_jax.state.context import (
    activation_mesh,
    constrain_activation,
    constrain_logits,
    constrain_unsplit,
    gathered,
    vocab_axis,
)

__all__ = ["constrain_activation", "constrain_logits", "constrain_unsplit", "lookup"]


def lookup(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """``embed(tokens)``, its table gathered over the batch axes before the lookup and the result placed over the
    batch (`constrain_activation`). Where the plan has a tensor axis that divides the vocabulary, the lookup is
    Megatron's vocabulary-parallel one: each tensor rank keeps its rows of the table, looks up the tokens that fall
    in them (zeros elsewhere) and a sum over the tensor axis joins the pieces; its gradient stays in the rank's rows
    (left to XLA, a vocabulary-split table's gradient is scattered into a whole table on every chip)."""
    table = embed.embedding[...]
    if embed.dtype is not None:
        table = table.astype(embed.dtype)
    axis, where = vocab_axis(), activation_mesh()
    if axis is None or where is None or jax.sharding.get_abstract_mesh().manual_axes:
        return constrain_activation(jnp.take(gathered(table), tokens, axis=0))
    mesh, batch_axes, seq = where
    t = dict(mesh.shape)[axis]
    seq = tuple(a for a in (seq if isinstance(seq, tuple) else (seq,)) if a and a != axis) or None
    seq = seq[0] if seq and len(seq) == 1 else seq
    if table.shape[0] % t or tokens.ndim != 2:
        return constrain_activation(jnp.take(gathered(table), tokens, axis=0))
    table = gathered(table, (axis, None))

    def rows(local: jax.Array, ids: jax.Array) -> jax.Array:
        n = local.shape[0]
        offset = ids - jax.lax.axis_index(axis) * n
        hit = (offset >= 0) & (offset < n)
        found = jnp.take(local, jnp.clip(offset, 0, n - 1), axis=0)
        return jax.lax.psum(jnp.where(hit[..., None], found, jnp.zeros((), found.dtype)), axis)

    ids_spec = P(batch_axes, seq)
    out = jax.shard_map(rows, mesh=mesh, in_specs=(P(axis, None), ids_spec), out_specs=P(batch_axes, seq, None))(
        table, tokens
    )
    return constrain_activation(out)
