"""The GPU compiler settings: computed from the recipes and the model, given to a GPU step's compile, left out where
the user set them, never given on CPU; every option name and value is one this XLA takes."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import openhosti_jax as oh
from openhosti_jax.errors import ConfigError
from openhosti_jax.models.gpt import GPT, GPTConfig
from openhosti_jax.policies import compiler
from openhosti_jax.policies.compiler import GPU_SETTINGS, JAX_TOOLBOX, MAXTEXT_1VM, layer_bytes, settings_for
from openhosti_jax.train import spmd_step

THRESHOLDS = ("all_gather", "reduce_scatter", "all_reduce")


def _gpt_params(scan: bool, **kw):
    model = nnx.eval_shape(lambda: GPT(GPTConfig.tiny(scan_layers=scan, **kw), rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param, ...)[1]


def _block_params(cfg: GPTConfig) -> int:
    """One block's parameters in closed form: two norms, q/k/v without bias, the output projection, the MLP."""
    d, a, h = cfg.d_model, cfg.attention_width, cfg.mlp_width
    return 2 * 2 * d + 3 * d * a + (a * d + d) + (d * h + h) + (h * d + d)


@pytest.mark.parametrize("scan", [False, True])
def test_one_layer_bytes_is_a_blocks_parameters_whether_listed_or_stacked(scan):
    assert layer_bytes(_gpt_params(scan)) == 4 * _block_params(GPTConfig.tiny())


def test_gpu_settings_are_the_recipes_with_thresholds_raised_to_one_layer():
    small = settings_for("gpu", layer_bytes=1000, xla_flags="", opt_level="UNKNOWN").options()
    big = settings_for("gpu", layer_bytes=3 * 2**30, xla_flags="", opt_level="UNKNOWN").options()
    for c, floor in zip(THRESHOLDS, (128 * 2**20, 64 * 2**20, 128 * 2**20), strict=True):
        assert small[f"xla_gpu_{c}_combine_threshold_bytes"] == floor  # MaxText's 1vm.sh values
        assert big[f"xla_gpu_{c}_combine_threshold_bytes"] == 3 * 2**30  # at least one layer's weights
        assert small[f"xla_gpu_enable_pipelined_{c}"] is True
    assert small["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert small["xla_gpu_enable_while_loop_double_buffering"] is True
    assert small["xla_disable_hlo_passes"] == "rematerialization"
    assert small["optimization_level"] == jax._src.config.EffortLevel.O1.value
    assert len(small) == len(GPU_SETTINGS)
    assert all(MAXTEXT_1VM in s.source or JAX_TOOLBOX in s.source for s in GPU_SETTINGS)


def test_every_gpu_option_is_one_this_xla_takes():
    """XLA checks compile option names and values against its DebugOptions on any backend: the CPU compile proves
    each GPU name exists in this jaxlib, and a misspelt one is refused the same way."""
    options = settings_for("gpu", layer_bytes=2**28, xla_flags="", opt_level="UNKNOWN").options()
    x = jnp.arange(4.0)
    assert jax.jit(lambda v: v * 2, compiler_options=options).lower(x).compile()(x).tolist() == [0, 2, 4, 6]
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda v: v * 2, compiler_options={"xla_gpu_enable_latency_hiding_schedulerx": True}).lower(x).compile()


def test_the_users_flags_win():
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_all_gather_combine_threshold_bytes=1"
    s = settings_for("gpu", layer_bytes=2**30, xla_flags=user, opt_level="O0")
    options = s.options()
    assert "xla_gpu_enable_latency_hiding_scheduler" not in options
    assert "xla_gpu_all_gather_combine_threshold_bytes" not in options and "optimization_level" not in options
    assert set(s.user_kept) == {
        "xla_gpu_enable_latency_hiding_scheduler",
        "xla_gpu_all_gather_combine_threshold_bytes",
        "jax_optimization_level",
    }
    assert "left as the user set them" in s.describe()


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_nothing_is_set_off_a_gpu(platform):
    s = settings_for(platform, layer_bytes=2**30, xla_flags="", opt_level="UNKNOWN")
    assert s.options() == {} and "GPU settings apply on GPUs only" in s.describe()


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("OPENHOSTI_GPU_SETTINGS", "0")
    assert settings_for("gpu", layer_bytes=2**30, xla_flags="").options() == {}


def test_a_bad_setting_is_a_typed_error():
    with pytest.raises(ConfigError, match="expected 'xla' or 'jax'"):
        compiler.CompilerSetting("x", True, "here", "why", kind="cuda")


def _step(mesh):
    def init(r):
        return {"blocks": [{"w": jax.random.normal(k, (8, 8)) * 0.1} for k in jax.random.split(r, 3)]}

    state, plan = oh.create_train_state(init, optax.sgd(0.1), mesh, plan="fsdp")

    def train(state, batch):
        def loss(params):
            h = batch["x"]
            for block in params["blocks"]:
                h = jnp.tanh(h @ block["w"])
            return jnp.mean((h - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    return state, plan, train


def test_a_gpu_step_compiles_with_them_and_a_cpu_step_without(monkeypatch):
    mesh = oh.build_mesh(oh.MeshConfig(fsdp=2), jax.devices()[:2])
    batch = {"x": jnp.ones((4, 8)), "y": jnp.zeros((4, 8))}
    state, plan, train = _step(mesh)
    cpu = oh.spmd(train, mesh=mesh, plan=plan, donate=False)
    _, cpu_metrics = cpu(state, batch)
    assert cpu.settings.options() == {} and cpu.lower(state, batch)._lowering._compiler_options_kvs == ()
    assert any("compiler settings: none set (cpu backend" in e for e in cpu.report.events)

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true")
    monkeypatch.setattr(spmd_step, "step_settings", functools.partial(compiler.step_settings, platform="gpu"))
    gpu = oh.spmd(train, mesh=mesh, plan=plan, donate=False)  # traced on CPU as it would be for a GPU target
    _, gpu_metrics = gpu(state, batch)
    given = dict(gpu.lower(state, batch)._lowering._compiler_options_kvs)
    want = settings_for("gpu", 8 * 8 * 4, opt_level="UNKNOWN").options()  # one block: an 8 x 8 fp32 matrix
    assert given == want and "xla_gpu_enable_triton_gemm" not in given and gpu.settings.layer_bytes == 256
    line = next(e for e in gpu.report.events if e.startswith("compiler settings for gpu"))
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in line and "xla_gpu_enable_triton_gemm" in line
    assert float(gpu_metrics["loss"]) == pytest.approx(float(cpu_metrics["loss"]), rel=1e-6)  # same program's math
    off = oh.spmd(train, mesh=mesh, plan=plan, donate=False, compiler_settings=False)
    off(state, batch)
    assert off.settings.options() == {} and "compiler_settings=False" in off.settings.describe()
