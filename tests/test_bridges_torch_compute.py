"""wrap_for_torch: JAX forward/backward inside torch autograd, gradients equal torch's own of the same math."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from openhosti_jax.bridges import wrap_for_torch  # noqa: E402
from openhosti_jax.errors import BridgeError  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)


def _jax_layer(x, w, b):
    return jnp.tanh(x @ w + b) ** 2, jnp.sum(jnp.sin(x), axis=1)


def _torch_layer(x, w, b):
    return torch.tanh(x @ w + b) ** 2, torch.sum(torch.sin(x), dim=1)


def test_gradients_equal_torch_autograd():
    rng = np.random.default_rng(0)
    x, w, b = (rng.normal(size=s).astype(np.float32) for s in [(6, 4), (4, 3), (3,)])
    f = wrap_for_torch(_jax_layer)

    def grads(layer):
        tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
        y, z = layer(tx, tw, tb)
        (y.sum() * 0.5 + (z**2).mean()).backward()
        return y.detach().numpy(), z.detach().numpy(), tx.grad.numpy(), tw.grad.numpy(), tb.grad.numpy()

    for got, want in zip(grads(f), grads(_torch_layer), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    with jax.enable_x64(True):
        f = wrap_for_torch(lambda x, w: jnp.tanh(x @ w))
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(f, (x, w))


def test_integer_inputs_are_not_differentiated():
    f = wrap_for_torch(lambda table, idx: (table[idx] ** 2).sum())
    table = torch.arange(12.0).reshape(4, 3).requires_grad_()
    idx = torch.tensor([0, 2, 2])
    f(table, idx).backward()
    want = torch.zeros(4, 3)
    want[0] = 2 * table.detach()[0]
    want[2] = 4 * table.detach()[2]
    np.testing.assert_array_equal(table.grad.numpy(), want.numpy())


@pytest.mark.timeout(120)
def test_sharded_function_in_a_torch_training_loop_matches_pure_torch():
    mesh = jax.make_mesh((8,), ("data",))
    shard = jax.NamedSharding(mesh, jax.P("data"))
    f = wrap_for_torch(lambda x, w: jnp.tanh(x @ w), in_shardings=(shard, None))
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(4, 16, 5)).astype(np.float32)
    ys = rng.normal(size=(4, 16, 2)).astype(np.float32)
    w0 = rng.normal(size=(5, 2)).astype(np.float32)

    def train(layer):
        w = torch.nn.Parameter(torch.tensor(w0))
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        losses = []
        for x, y in zip(xs, ys, strict=True):
            opt.zero_grad()
            loss = ((layer(torch.tensor(x), w) - torch.tensor(y)) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return np.array(losses), w.detach().numpy()

    got_losses, got_w = train(f)
    want_losses, want_w = train(lambda x, w: torch.tanh(x @ w))
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_bad_arguments():
    f = wrap_for_torch(lambda x: x * 2)
    with pytest.raises(BridgeError, match="expected torch tensors"):
        f(3.0)
    g = wrap_for_torch(lambda x, y: x * y, in_shardings=(None,))
    with pytest.raises(BridgeError, match="one per in_shardings"):
        g(torch.ones(2), torch.ones(2))
