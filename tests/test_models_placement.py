"""Where the bundled models place their activations under a plan (`openhosti_jax.models.placement`): the same
numbers as one device, and the program holding what the placement promises (each chip's own tokens; the
vocabulary-parallel lookup's gradient in its rank's rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from openhosti_jax.demo.examples import gpt_step
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.planner import PROFILES
from openhosti_jax.planner.search import Candidate, score
from openhosti_jax.planner.workload import workload
from openhosti_jax.train import create_train_state, spmd

CFG = LlamaConfig(
    vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128, scan_layers=True
)


def _init(r):
    return Llama(CFG, rngs=nnx.Rngs(r))


@pytest.mark.parametrize(
    ("sizes", "sequence"),
    [  # (fsdp alone is every planned step's equality with jax.jit, tests/test_train_spmd.py)
        ({"fsdp": 4, "tensor": 2}, False),
        ({"data": 2, "fsdp": 2, "tensor": 2}, True),  # sequence parallel: the head's input gathered first
    ],
)
def test_a_placed_llama_step_equals_one_device(sizes, sequence):
    """Two SGD steps of a scanned Llama under ZeRO-3 with its activations placed (the embedding looked up from a
    gathered table, vocabulary-parallel over the tensor axis) against the same steps on one device: losses and
    parameters to float32 rounding."""
    tx = optax.sgd(0.1)
    tokens = jax.random.randint(jax.random.key(1), (2, 8, 32), 0, CFG.vocab_size)
    full = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **sizes}
    work = workload(_init, jax.ShapeDtypeStruct((8, 32), jnp.int32))
    runs = []
    for mesh_sizes, devices in ((full, None), ({a: 1 for a in full}, jax.devices()[:1])):
        mesh = build_mesh(MeshConfig.from_sizes(mesh_sizes), devices)
        zero = 3 if mesh.size > 1 else 0
        plan = score(work, tx, Candidate(mesh_sizes, zero, sequence_parallel=sequence), PROFILES["H100"]).plan
        state, plan = create_train_state(_init, tx, mesh, plan=plan, seed=0)
        step = spmd(gpt_step, mesh=mesh, plan=plan)
        losses = []
        for batch in tokens:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs.append((losses, jax.tree.map(np.asarray, jax.device_get(state.params))))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), runs[0][1], runs[1][1])


def test_the_vocabulary_parallel_lookup_keeps_its_gradient_in_the_ranks_rows():
    """fsdp=4 x tensor=2: the compiled step holds no whole-table buffer of the embedding's shape (a split table's
    gradient scattered into a whole one on every device is what XLA does unplaced)."""
    sizes = {"stage": 1, "data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    tx = optax.sgd(0.1)
    work = workload(_init, jax.ShapeDtypeStruct((8, 32), jnp.int32))
    plan = score(work, tx, Candidate(sizes, 3), PROFILES["H100"]).plan
    mesh = build_mesh(MeshConfig.from_sizes(sizes))
    state, plan = create_train_state(_init, tx, mesh, plan=plan, seed=0)
    text = spmd(gpt_step, mesh=mesh, plan=plan).lower(state, jnp.zeros((8, 32), jnp.int32)).compile().as_text()
    whole = f"[{CFG.vocab_size},{CFG.d_model}]"
    scatters = [line for line in text.splitlines() if " scatter(" in line and whole in line.split("=")[1][:40]]
    assert not scatters, scatters[:2]
    assert f"[{CFG.vocab_size // 2},{CFG.d_model}]" in text  # each rank's rows
