"""Tensor (and sequence) parallelism inside pipeline stages: a ``stage x tensor x data`` and a ``stage x tensor x
fsdp`` (ZeRO-3) mesh train the bundled GPT and Llama through create_train_state, pipeline_step and Trainer to the
losses, parameters and Adam moments of one device running the plain model; each stage's devices hold their
stage's layers only, and each tensor rank of a stage exactly its Megatron block of every tensor-parallel weight
(column-parallel weights by output features, row-parallel by input features). Bad input is a typed error.

Collective runs happen in a subprocess with a timeout (a half-entered collective would hang the test process).
"""

import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_pipeline_executor import run_script

import openhosti_jax as oh
from openhosti_jax.errors import PipelineError
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.pipeline import LayerCost, evaluate_partition, gpipe
from openhosti_jax.pipeline.state import init_pipeline_state, make_pipeline_train_step

HARNESS = """
from flax import nnx
import openhosti_jax as oh
from openhosti_jax.models.gpt import GPT, GPTConfig, next_token_loss
from openhosti_jax.models.llama import Llama, LlamaConfig
from openhosti_jax.train import to_model_state

MODELS = {
    "gpt": lambda r: GPT(GPTConfig.tiny(n_layers=2), rngs=nnx.Rngs(r)),
    "llama": lambda r: Llama(LlamaConfig.tiny(n_layers=2), rngs=nnx.Rngs(r)),
}
tok = jax.random.randint(jax.random.key(3), (8, 32), 0, 256)
# Adam moves a coordinate by up to lr / eps per unit of its gradient (where the gradient is near eps): with the
# default eps (1e-8) the 1e-8 rounding differences of any sharded run (the gradients of the pipeline over tensor
# and over data alone both differ from one device's by that much) would move parameters by 1e-3. eps=1e-5 bounds
# the gain at 100; the moments, linear in the gradients, are compared directly as well.
tx = optax.adam(1e-3, eps=1e-5)
STEPS = 3
mean_loss = lambda logits, t: (lambda a: a[0] / a[1])(next_token_loss(logits, t))

def reference(init, params):
    # the plain model on one device: losses, gradient norms, then parameters and Adam state after STEPS steps
    graphdef, _, rest = nnx.split(init(0), nnx.Param, ...)
    def loss_fn(p):
        return mean_loss(nnx.merge(graphdef, p, rest)(tok), tok)
    @jax.jit
    def step(p, o):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss, optax.global_norm(g)
    p = jax.device_put(params, jax.devices()[0])
    o = tx.init(p)
    losses, norms = [], []
    for _ in range(STEPS):
        p, o, loss, norm = step(p, o)
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms, p, o

def tensor_blocks(state, mesh, suffix):
    # the leaf of the first block whose path ends with `suffix`, read from the devices: for each tensor rank t,
    # the part of the stage's packed row that rank's devices hold (slot t, gathered over fsdp), cut to the leaf,
    # against the model leaf's t-th block along its split dim; and whether only that rank's devices hold slot t
    params = jax.device_get(to_model_state(state)[0])
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [jax.tree_util.keystr(k) for k, _ in flat]
    full = flat[next(i for i, p in enumerate(paths) if "['blocks'][0]" in p and p.endswith(suffix))][1]
    layer_paths = state.sequence.split_flat(paths, lambda p, j: f"{p}[{j}]")
    li, i = next((li, i) for li, ps in enumerate(layer_paths) for i, p in enumerate(ps)
                 if "['blocks'][0]" in p and p.endswith(suffix))
    packing = state.packing
    c = next(c for c, r in enumerate(packing.stages) if li in r)
    v, d = c // packing.num_stages, c % packing.num_stages
    leaf = packing.leaves[c][sum(len(layer_paths[j]) for j in packing.stages[c] if j < li) + i]
    axes = list(mesh.axis_names)
    where = {dev: dict(zip(axes, np.argwhere(mesh.devices == dev)[0])) for dev in mesh.devices.flat}
    t_count, width = packing.tensor, packing.slot
    slots = np.zeros((t_count, width), np.float32)
    only_own = True
    for shard in state.params.addressable_shards:
        _, rows, cols = shard.index
        if rows.start != d:
            continue
        at = where[shard.device]
        lo = cols.start or 0
        t = lo // width
        only_own &= int(at["tensor"]) == t and int(at["stage"]) == d
        slots[t, lo - t * width : lo - t * width + shard.data.shape[2]] = np.asarray(shard.data)[v, 0]
    err = 0.0
    for t in range(t_count):
        part = slots[t, leaf.offset : leaf.offset + leaf.length]
        k = leaf.dim
        n = full.shape[k] // t_count
        want = np.take(np.asarray(full), np.arange(t * n, (t + 1) * n), axis=k)
        err = max(err, float(np.max(np.abs(part.reshape(want.shape) - want))))
    return {"dim": leaf.dim, "block_err": err, "only_own_rank": bool(only_own)}

def run(name, axes, zero, sequence_parallel, trainer=False):
    mesh = oh.build_mesh(oh.MeshConfig(stage=2, **axes))
    plan = oh.ShardingPlan.from_zero({}, None, dict(mesh.shape), zero, pipeline_stages=2, num_microbatches=2,
                                     sequence_parallel=sequence_parallel)
    state, _ = oh.create_train_state(MODELS[name], tx, mesh, plan=plan, sample_batch=tok)
    params0 = jax.device_get(to_model_state(state)[0])
    ref_losses, ref_norms, ref_p, ref_o = reference(MODELS[name], params0)
    column = {"gpt": "['fc']['kernel'].value", "llama": "['up']['kernel'].value"}[name]
    row = {"gpt": "['out']['kernel'].value", "llama": "['down']['kernel'].value"}[name]
    layout = {"column": tensor_blocks(state, mesh, column), "row": tensor_blocks(state, mesh, row)}
    step = oh.pipeline_step(mean_loss, mesh, state)
    if trainer:
        result = oh.Trainer(step, progress=False).fit(state, iter([(tok, tok)] * STEPS), STEPS)
        state = result.state
        losses = [r["loss"] for r in result.history]
        norms = [r["grad_norm"] for r in result.history]
    else:
        losses, norms = [], []
        for _ in range(STEPS):
            state, m = step(state, (tok, tok))
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
    p, o = to_model_state(state)
    device = jax.devices()[0]
    held = sum(s.data.size for s in state.params.addressable_shards if s.device == device)
    return {
        "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "norm_err": max(abs(a - b) for a, b in zip(norms, ref_norms)),
        "param_err": max_err(p, ref_p),
        "opt_err": max_err(o, ref_o),
        "opt_leaves": [len(jax.tree.leaves(o)), len(jax.tree.leaves(ref_o))],
        "loss_drop": losses[-1] < losses[0],
        "spec": str(state.params.sharding.spec),
        "held_fraction": held / state.params.size,
        "layout": layout,
    }
"""


def _check(r: dict, spec: str, held: float) -> None:
    assert r["loss_err"] < 1e-5 and r["norm_err"] < 1e-5, r
    assert r["param_err"] < 1e-5 and r["opt_err"] < 1e-5, r  # Adam's moments: each leaf's own gradients
    assert r["opt_leaves"][0] == r["opt_leaves"][1] and r["loss_drop"], r
    assert r["spec"] == spec, r
    assert r["held_fraction"] == pytest.approx(held), r  # 1/S of the parameters, 1/T of that, 1/F under ZeRO-3
    # each tensor rank of the stage holds its Megatron block: column-parallel by output, row-parallel by input
    assert r["layout"]["column"]["dim"] == 1 and r["layout"]["row"]["dim"] == 0, r
    for kind in ("column", "row"):
        assert r["layout"][kind]["only_own_rank"] and r["layout"][kind]["block_err"] == 0.0, r


@pytest.mark.slow  # 85-110 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_stage_tensor_data_trains_gpt_and_llama_like_one_device(tmp_path):
    out = run_script(
        HARNESS
        + """
res = {name: run(name, {"tensor": 2, "data": 2}, 0, False) for name in ("gpt", "llama")}
print(json.dumps(res))
""",
        tmp_path,
        timeout=560,
    )
    for name in ("gpt", "llama"):
        _check(out[name], "P(None, 'stage', 'tensor')", 1 / 4)


@pytest.mark.slow  # 60-85 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_stage_tensor_fsdp_zero3_sequence_parallel_trains_through_the_trainer(tmp_path):
    out = run_script(
        HARNESS
        + """
print(json.dumps({"gpt": run("gpt", {"tensor": 2, "fsdp": 2}, 3, True, trainer=True)}))
""",
        tmp_path,
        timeout=560,
    )
    _check(out["gpt"], "P(None, 'stage', ('tensor', 'fsdp'))", 1 / 8)


def _plan(mesh):
    return oh.ShardingPlan.from_zero({}, None, dict(mesh.shape), 0, pipeline_stages=2, num_microbatches=2)


def test_heads_a_stages_tensor_axis_does_not_divide_are_a_typed_error():
    tokens = jnp.zeros((8, 16), jnp.int32)
    mesh = oh.build_mesh(oh.MeshConfig(stage=2, tensor=2, data=2))
    three_heads = lambda r: GPT(GPTConfig.tiny(d_model=48, n_heads=3), rngs=nnx.Rngs(r))  # noqa: E731
    with pytest.raises(PipelineError, match=r"whole attention heads(.|\n)*layer 1(.|\n)*qkv(.|\n)*found 2"):
        oh.create_train_state(three_heads, optax.adam(1e-3), mesh, plan=_plan(mesh), sample_batch=tokens)
    mesh4 = oh.build_mesh(oh.MeshConfig(stage=2, tensor=4))
    two_kv_heads = lambda r: Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(r))  # noqa: E731  (4 heads, 2 KV heads)
    with pytest.raises(PipelineError, match=r"key/value(.|\n)*wk(.|\n)*found 4"):
        oh.create_train_state(two_kv_heads, optax.adam(1e-3), mesh4, plan=_plan(mesh4), sample_batch=tokens)


def test_tensor_specs_that_do_not_fit_and_a_mesh_the_state_was_not_packed_for_are_typed_errors():
    mesh = oh.build_mesh(oh.MeshConfig(stage=2, tensor=2, data=2))
    cut = evaluate_partition([LayerCost(1, 1, 1, 1, 1, 1)] * 2, (0, 1, 2), 2)
    params = [{"w": jnp.ones((4, 3))}, {"w": jnp.ones((3, 4))}]
    with pytest.raises(PipelineError, match=r"layer 0 leaf \['w'\].*dim 1 of shape \(4, 3\) over tensor=2"):
        init_pipeline_state(params, optax.sgd(0.1), mesh, cut, gpipe(2, 2), tensor_specs=[P(None, "tensor")] * 2)
    with pytest.raises(PipelineError, match="one tensor-parallel spec tree per layer"):
        init_pipeline_state(params, optax.sgd(0.1), mesh, cut, gpipe(2, 2), tensor_specs=[P()])
    state = init_pipeline_state(
        params, optax.sgd(0.1), mesh, cut, gpipe(2, 2), tensor_specs=[{"w": P("tensor", None)}, {"w": P()}]
    )
    assert state.packing.tensor_specs == [(P("tensor", None),), (P(None, None),)]
    layers = [lambda p, x: x @ p["w"]] * 2
    no_tensor = oh.build_mesh(oh.MeshConfig(stage=2, data=4))
    with pytest.raises(PipelineError, match="packed for a tensor axis of 2 but the mesh's is 1"):
        make_pipeline_train_step(layers, lambda y, t: jnp.mean((y - t) ** 2), no_tensor, cut, gpipe(2, 2), state)
