"""The persistent compile cache: on by default under the library's cache directory, the user's jax settings win,
and a second process running the same step loads it instead of compiling it."""

import json
import os
import stat
import subprocess
import sys

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from openhosti_jax.train import compile_cache
from openhosti_jax.train.compile_cache import cache_path, caching_steps, enable_compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_jax_cache(monkeypatch, tmp_path):
    """jax's cache settings as a new process has them, restored after."""
    monkeypatch.delenv("OPENHOSTI_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("OPENHOSTI_CACHE_DIR", str(tmp_path / "oh"))
    names = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size", "jax_enable_compilation_cache")
    saved = {k: getattr(jax.config, k) for k in names}
    jax.config.update("jax_compilation_cache_dir", None)
    yield tmp_path
    for k, v in saved.items():
        jax.config.update(k, v)
    jax_cache.reset_cache()


def test_on_by_default_under_the_librarys_directory_owner_only(fresh_jax_cache):
    got = enable_compile_cache()
    assert got.chosen_by == "openhosti" and got.directory == str(cache_path())
    assert cache_path().parent.parent == fresh_jax_cache / "oh" and jax.__version__ in cache_path().name
    assert jax.config.jax_compilation_cache_dir == str(cache_path())
    assert stat.S_IMODE(os.stat(cache_path()).st_mode) == 0o700
    assert jax.config.jax_compilation_cache_max_size == compile_cache.DEFAULT_MAX_BYTES
    again = enable_compile_cache()  # a second call keeps the first decision
    assert (again.chosen_by, again.directory) == (got.chosen_by, got.directory)
    with caching_steps():  # the library's step is written however fast it compiled
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.JAX_MIN_COMPILE_SECONDS


def test_the_users_jax_settings_win(fresh_jax_cache, monkeypatch):
    jax.config.update("jax_compilation_cache_dir", str(fresh_jax_cache / "mine"))
    got = enable_compile_cache()
    assert (got.chosen_by, got.directory) == ("user", str(fresh_jax_cache / "mine"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "5")
    with caching_steps():  # the user's threshold holds for the step too
        assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.JAX_MIN_COMPILE_SECONDS
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    assert enable_compile_cache().describe() == "compile cache: off (jax_enable_compilation_cache=False)"
    assert jax.config.jax_compilation_cache_dir is None


CHILD = """
import json, logging, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, optax
from flax import nnx
import openhosti_jax as oh
from openhosti_jax.models.gpt import GPT, GPTConfig, make_corpus, next_token_loss

class Count(logging.Handler):  # jax's compiler logs each persistent-cache hit and miss with the program's name
    hits = misses = 0
    def emit(self, record):
        text = record.getMessage()
        if "'jit_traced" in text:
            Count.hits += text.startswith("Persistent compilation cache hit")
            Count.misses += text.startswith("PERSISTENT COMPILATION CACHE MISS")

log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.addHandler(Count())
mesh = oh.build_mesh(oh.MeshConfig(data=2, fsdp=4))
state, plan = oh.create_train_state(lambda r: GPT(GPTConfig.tiny(), rngs=nnx.Rngs(r)), optax.adamw(1e-3), mesh,
                                    plan="fsdp")

@oh.spmd(mesh=mesh, plan=plan)
def step(state, batch):
    def loss(p):
        total, n = next_token_loss(state.apply_fn(p, batch["tokens"]), batch["tokens"])
        return total / n
    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}

batch = {"tokens": jnp.asarray(make_corpus(8, 32))}
for _ in range(2):
    state, metrics = step(state, batch)
print(json.dumps({"step_compiles": Count.misses, "step_cache_hits": Count.hits, "loss": float(metrics["loss"]),
                  "cache": step.compile_cache.directory, "files": len(os.listdir(step.compile_cache.directory))}))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_process_loads_the_step_instead_of_compiling_it(tmp_path):
    env = {**os.environ, "OPENHOSTI_CACHE_DIR": str(tmp_path), "OPENHOSTI_COMPILE_CACHE": "1", "PYTHONPATH": ROOT}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["step_compiles"] == 1 and first["step_cache_hits"] == 0 and first["files"] >= 1
    assert second["step_compiles"] == 0 and second["step_cache_hits"] == 1  # loaded, not compiled
    assert second["loss"] == first["loss"]  # the loaded executable computes what the compiled one did
    assert first["cache"] == second["cache"] and first["cache"].startswith(str(tmp_path))
