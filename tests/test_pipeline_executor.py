"""Pipelined loss and gradients equal the unpipelined model's (single device, full batch) within 1e-5.

Collective runs happen in subprocesses with timeouts (a half-entered collective would hang the test process).
"""

import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

from openhosti_jax.errors import BatchError, PipelineError
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.pipeline import LayerCost, evaluate_partition, gpipe, make_pipeline_step

MODEL = """
import json, math, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, optax
from openhosti_jax.mesh import MeshConfig, build_mesh
from openhosti_jax.pipeline import *

k = jax.random.split(jax.random.key(0), 8)
def embed(p, tok):  # int tokens (B, 4) -> (B, 32)
    return p[tok].reshape(tok.shape[0], -1)
def dense(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])
def resid(p, x):
    return x + jnp.sin(x @ p[0]) * p[1]
def head(p, x):
    return x @ p
LAYERS = [embed, dense, resid, dense, dense, head]
PARAMS = [
    jax.random.normal(k[0], (11, 8)),
    {"w": 0.3 * jax.random.normal(k[1], (32, 16)), "b": jnp.zeros(16)},
    (0.3 * jax.random.normal(k[2], (16, 16)), jnp.float32(0.5)),
    {"w": 0.5 * jax.random.normal(k[3], (16, 6)), "b": 0.1 * jnp.ones(6)},
    {"w": 0.5 * jax.random.normal(k[4], (6, 6)), "b": jnp.zeros(6)},
    jax.random.normal(k[5], (6, 3)),
]
TOK = jax.random.randint(k[6], (16, 4), 0, 11)
LAB = jax.random.randint(k[7], (16,), 0, 3)
def mean_loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
def model_loss(params, tok, lab):
    h = tok
    for f, p in zip(LAYERS, params):
        h = f(p, h)
    return mean_loss_fn(h, lab)
def single_device_reference(params, tok, lab):
    cpu0 = jax.devices()[0]
    args = jax.device_put((params, tok, lab), cpu0)
    return jax.device_get(jax.jit(jax.value_and_grad(model_loss))(*args))
def max_err(a, b):
    pairs = zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)))
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)
"""


def run_script(body: str, tmp_path, timeout: int = 400) -> dict:
    path = tmp_path / "run.py"
    path.write_text(MODEL + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, env=env, cwd=os.getcwd()
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 13 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(450)
def test_gpipe_and_1f1b_match_unpipelined_on_4_stages_x_2_data(tmp_path):
    out = run_script(
        """
        ref_loss, ref_grads = single_device_reference(PARAMS, TOK, LAB)
        mesh = build_mesh(MeshConfig(stage=4, data=2))
        costs = layer_costs(LAYERS, PARAMS, TOK[:2])
        cut = partition(costs, 4, 4)
        res = {"sizes": [len(r) for r in cut.stages]}
        for sch in (gpipe(4, 4), one_f_one_b(4, 4)):
            loss, grads = pipeline_value_and_grad(LAYERS, PARAMS, (TOK, LAB), mean_loss_fn, mesh, cut, sch)
            res[sch.name] = [abs(float(loss) - float(ref_loss)), max_err(grads, ref_grads), float(ref_loss)]
        print(json.dumps(res))
        """,
        tmp_path,
    )
    assert sum(out["sizes"]) == 6 and len(out["sizes"]) == 4
    for name in ("gpipe", "1f1b"):
        loss_err, grad_err, ref_loss = out[name]
        assert ref_loss > 0.1
        assert loss_err < 1e-5, (name, loss_err)
        assert grad_err < 1e-5, (name, grad_err)


@pytest.mark.slow  # 16 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(450)
def test_interleaved_and_nnx_fsdp_match_unpipelined(tmp_path):
    out = run_script(
        """
        from flax import nnx
        ref_loss, ref_grads = single_device_reference(PARAMS, TOK, LAB)
        costs = layer_costs(LAYERS, PARAMS, TOK[:2])
        mesh = build_mesh(MeshConfig(stage=2, data=4))
        sch = interleaved_one_f_one_b(2, 2, 2)
        cut = partition(costs, 4, 2)
        loss, grads = pipeline_value_and_grad(LAYERS, PARAMS, (TOK, LAB), mean_loss_fn, mesh, cut, sch)
        res = {"interleaved": [abs(float(loss) - float(ref_loss)), max_err(grads, ref_grads)]}

        class Block(nnx.Module):
            def __init__(self, din, dout, seed):
                self.lin = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
            def __call__(self, x):
                return jnp.tanh(self.lin(x))
        mods = [Block(5, 16, 0), Block(16, 16, 1), nnx.Linear(16, 4, rngs=nnx.Rngs(2))]
        fns, states = split_modules(mods)
        x = jax.random.normal(k[0], (16, 5)); y = jax.random.normal(k[1], (16, 4))
        mse = lambda o, t: jnp.mean((o - t) ** 2)
        def ref(states):
            h = x
            for f, s in zip(fns, states):
                h = f(s, h)
            return mse(h, y)
        r_loss, r_grads = jax.value_and_grad(ref)(states)
        mesh = build_mesh(MeshConfig(stage=2, data=2, fsdp=2))
        cut = partition(layer_costs(fns, states, x[:2]), 2, 2)
        loss, grads = pipeline_value_and_grad(fns, states, (x, y), mse, mesh, cut, one_f_one_b(2, 2))
        res["nnx"] = [abs(float(loss) - float(r_loss)), max_err(grads, r_grads)]
        print(json.dumps(res))
        """,
        tmp_path,
    )
    for name in ("interleaved", "nnx"):
        loss_err, grad_err = out[name]
        assert loss_err < 1e-5 and grad_err < 1e-5, (name, out[name])


def test_bad_requests_raise_typed_errors():
    mesh = build_mesh(MeshConfig(stage=2, data=4))
    layers = [lambda p, x: x @ p] * 2
    cut = evaluate_partition([LayerCost(0, 0, 1, 1, 1, 1.0)] * 2, (0, 1, 2), 2)
    mse = lambda o, t: jnp.mean((o - t) ** 2)
    step = make_pipeline_step(layers, mse, mesh, cut, gpipe(2, 2))
    with pytest.raises(BatchError, match="divisible by 4 replicas x 2 microbatches"):
        step([jnp.eye(3)] * 2, (jnp.ones((12, 3)), jnp.ones((12, 3))))
    with pytest.raises(PipelineError, match="stage axis is 2"):
        make_pipeline_step(layers, mse, mesh, cut, gpipe(4, 2))
    with pytest.raises(PipelineError, match="partition into 4"):
        make_pipeline_step(layers, mse, build_mesh(MeshConfig(stage=4, data=2)), cut, gpipe(4, 2))
