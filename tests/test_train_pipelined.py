"""A pipelined plan trains through the library's entry points: create_train_state gives a stage-local state,
pipeline_step trains it, Trainer.fit runs it with TrainerCheckpoint, and its checkpoint comes back onto the same
pipeline and, as the model's own state, continues without a pipeline to the same losses."""

import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from test_pipeline_executor import run_script
from test_pipeline_split import GPT_REFERENCE

import openhosti_jax as oh
from openhosti_jax.errors import PipelineError, StateError
from openhosti_jax.models.gpt import GPT, GPTConfig

TRAIN = (
    GPT_REFERENCE
    + """
import openhosti_jax as oh
from openhosti_jax.train import from_model_state, to_model_state
mesh = oh.build_mesh(oh.MeshConfig(stage=2, data=4))
plan = oh.ShardingPlan.from_zero({}, None, dict(mesh.shape), 0, pipeline_stages=2, num_microbatches=4)
directory = os.environ["CKPT_DIR"]

def fresh():
    return oh.create_train_state(init, tx, mesh, plan=plan, sample_batch=tok, seed=0)[0]

state = fresh()
step = oh.pipeline_step(mean_loss, mesh, state)
data = lambda: iter([(tok, tok)] * 100)
trainer = lambda: oh.Trainer(step, checkpoint=oh.TrainerCheckpoint(directory, every_steps=2), progress=False)
result = trainer().fit(state, data(), 4)
losses = [r["loss"] for r in result.history]
# the same run on one device, from the same initial parameters
plain, _, _ = plain_losses(params, tx.init(params), 6)
# resume the pipelined run from its checkpoint (step 4) for two more steps
resumed = trainer().fit(fresh(), data(), 6)
after = [r["loss"] for r in resumed.history]
# leave the pipeline: the model's own state continues on one device
params, opt = to_model_state(result.state)
off, _, _ = plain_losses(params, opt, 2)
back = from_model_state(params, opt, result.state, mesh, step=4)
before = jax.device_get((back.step, back.params, back.opt_state))
_, m = step(from_model_state(params, opt, result.state, mesh, step=4), (tok, tok))
# a non-finite loss leaves the pipelined state as it was
nan_step = oh.pipeline_step(lambda out, tgt: mean_loss(out, tgt) * jnp.where(tgt[0, 0] < 0, jnp.nan, 1.0), mesh, back)
kept, nan_m = nan_step(back, (tok, tok.at[0, 0].set(-1)))
unchanged = all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(before),
                jax.tree.leaves(jax.device_get((kept.step, kept.params, kept.opt_state)))))
print(json.dumps({"losses": losses, "plain": plain, "resumed": after, "off_pipeline": off,
                  "back_on": float(m["loss"]), "resumed_from": resumed.history[0]["step"],
                  "nan_skipped": int(nan_m["skipped_nonfinite"]), "nan_unchanged": unchanged}))
"""
)


@pytest.mark.slow  # 36 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(600)
def test_a_pipelined_plan_trains_checkpoints_and_leaves_the_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_DIR", str(tmp_path / "ckpt"))
    out = run_script(TRAIN, tmp_path, timeout=560)
    plain = out["plain"]
    for ours, ref in zip(out["losses"] + out["resumed"], plain, strict=True):
        assert abs(ours - ref) <= 1e-6 * abs(ref), (out["losses"], out["resumed"], plain)
    assert out["resumed_from"] == 5  # the resumed run continued after the checkpoint of step 4
    for ours, ref in zip(out["off_pipeline"], plain[4:], strict=True):
        assert abs(ours - ref) <= 1e-6 * abs(ref)
    assert abs(out["back_on"] - plain[4]) <= 1e-6 * abs(plain[4])
    assert out["nan_skipped"] == 1 and out["nan_unchanged"]


def test_a_pipelined_plan_is_refused_where_it_cannot_run():
    mesh = oh.build_mesh(oh.MeshConfig(stage=2, data=4))
    plan = oh.ShardingPlan.from_zero({}, None, dict(mesh.shape), 0, pipeline_stages=2, num_microbatches=4)
    init = lambda r: GPT(GPTConfig.tiny(n_layers=2), rngs=nnx.Rngs(r))
    with pytest.raises(StateError, match="pass sample_batch="):
        oh.create_train_state(init, optax.adam(1e-3), mesh, plan=plan)

    @oh.spmd(mesh=mesh, plan=plan)
    def step(state, batch):
        return state, {}

    with pytest.raises(StateError, match="openhosti_jax.pipeline_step"):
        step({"w": jnp.ones(2)}, jnp.ones((8, 2)))
    tokens = jnp.zeros((8, 16), jnp.int32)
    state, _ = oh.create_train_state(init, optax.adam(1e-3), mesh, plan=plan, sample_batch=tokens)
    deeper = GPT(GPTConfig.tiny(n_layers=3), rngs=nnx.Rngs(0))
    params = nnx.state(deeper, nnx.Param)
    with pytest.raises(PipelineError, match="the same layer count"):
        oh.train.from_model_state(params, optax.adam(1e-3).init(params), state, mesh)
    too_many = oh.ShardingPlan.from_zero({}, None, {"stage": 8}, 0, pipeline_stages=8, num_microbatches=8)
    with pytest.raises(PipelineError, match="at most that many stages"):
        oh.create_train_state(
            init, optax.adam(1e-3), oh.build_mesh(oh.MeshConfig(stage=8)), plan=too_many, sample_batch=tokens
        )
