"""The attention kernel each backend really has: cuDNN's fused attention on a GPU in half precision (jax's own
``implementation=None`` is XLA's everywhere), the Pallas splash kernel on a TPU (tests/test_models_splash.py), XLA's
elsewhere, and a typed error for a kernel a backend lacks."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from openhosti_jax.errors import ConfigError
from openhosti_jax.models import attention
from openhosti_jax.models.attention import attention_kernel, causal_attention
from openhosti_jax.models.llama import Llama, LlamaConfig


@pytest.mark.parametrize(
    ("kernel", "dtype", "head_dim", "backend", "expected"),
    [
        ("auto", jnp.bfloat16, 128, "gpu", "cudnn"),
        ("auto", jnp.float16, 64, "gpu", "cudnn"),
        ("auto", jnp.float32, 128, "gpu", "xla"),  # cuDNN's flash kernel is half precision only
        ("auto", jnp.bfloat16, 256, "gpu", "xla"),  # a head dim it does not take
        ("auto", jnp.bfloat16, 128, "tpu", "splash"),  # the Pallas kernel (tests/test_models_splash.py)
        ("auto", jnp.bfloat16, 128, "cpu", "xla"),
        ("xla", jnp.bfloat16, 128, "gpu", "xla"),
        ("cudnn", jnp.bfloat16, 128, "gpu", "cudnn"),
    ],
)
def test_the_kernel_each_backend_has(kernel, dtype, head_dim, backend, expected):
    assert attention_kernel(kernel, dtype, head_dim, backend) == expected


def test_a_kernel_the_backend_lacks_is_a_typed_error():
    with pytest.raises(ConfigError, match="backend 'cpu'.*Use 'auto'"):
        attention_kernel("cudnn", jnp.bfloat16, 128, "cpu")
    with pytest.raises(ConfigError, match="float32"):
        attention_kernel("cudnn", jnp.float32, 128, "gpu")
    with pytest.raises(ConfigError, match="attention_kernel='flash'"):
        LlamaConfig.tiny(attention_kernel="flash")
    model = Llama(LlamaConfig.tiny(attention_kernel="cudnn"), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="needs cuDNN"):
        model(jnp.zeros((1, 8), jnp.int32))


def test_on_a_gpu_backend_the_model_calls_cudnn_attention(monkeypatch):
    """The wiring: on a GPU backend, a bf16 model's attention goes to `jax.nn.dot_product_attention` with
    ``implementation="cudnn"``, the block size notwithstanding (traced only: this machine has no GPU)."""
    calls = []

    def spy(q, k, v, **kw):
        calls.append(kw.get("implementation"))
        return jnp.zeros_like(q)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention.jax.nn, "dot_product_attention", spy)
    q = jnp.ones((1, 16, 4, 64), jnp.bfloat16)
    kv = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
    jax.eval_shape(lambda a, b: causal_attention(a, b, b, block=8), q, kv)
    assert calls == ["cudnn"]
    calls.clear()
    jax.eval_shape(lambda a, b: causal_attention(a, b, b, block=8), q.astype(jnp.float32), kv.astype(jnp.float32))
    assert calls == []  # fp32: XLA's query blocks
