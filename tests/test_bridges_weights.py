"""Torch state_dict <-> Flax params: the Flax model reproduces the torch model's outputs within 1e-5."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from openhosti_jax.bridges import LayerMap, flax_to_torch, layer_maps, torch_to_flax  # noqa: E402
from openhosti_jax.errors import BridgeError  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 6)
        self.conv = torch.nn.Conv2d(2, 4, kernel_size=(3, 2), padding=(1, 0), stride=(1, 2))
        self.conv1d = torch.nn.Conv1d(6, 6, kernel_size=3, padding=1, groups=2, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))

    def forward(self, tokens, image):
        h = self.fc(self.ln(self.embed(tokens)))  # (B, L, 6)
        h = self.conv1d(h.transpose(1, 2)).mean(dim=2)  # (B, 6)
        c = torch.relu(self.conv(image)).mean(dim=(2, 3))  # NCHW -> (B, 4)
        return self.mlp(torch.cat([h, c], dim=1))


class FlaxNet(nn.Module):
    @nn.compact
    def __call__(self, tokens, image):
        h = nn.Dense(6, name="fc")(nn.LayerNorm(epsilon=1e-5, name="ln")(nn.Embed(11, 8, name="embed")(tokens)))
        h = nn.Conv(6, (3,), padding=[(1, 1)], feature_group_count=2, use_bias=False, name="conv1d")(h).mean(1)
        img = jnp.transpose(image, (0, 2, 3, 1))  # NCHW -> NHWC
        c = nn.Conv(4, (3, 2), strides=(1, 2), padding=[(1, 1), (0, 0)], name="conv")(img)
        c = nn.relu(c).mean(axis=(1, 2))
        x = jnp.concatenate([h, c], axis=1)
        return nn.Dense(3, name="mlp_out")(nn.relu(nn.Dense(10, name="mlp_in")(x)))


NAMES = {
    "embed": "embed",
    "ln": "ln",
    "fc": "fc",
    "conv": "conv",
    "conv1d": "conv1d",
    "mlp.0": "mlp_in",
    "mlp.2": "mlp_out",
}


def _net_and_inputs():
    torch.manual_seed(0)
    net = TorchNet().eval()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        net.ln.weight.uniform_(0.5, 1.5)
        net.ln.bias.uniform_(-0.5, 0.5)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 11, size=(3, 5))
    image = rng.normal(size=(3, 2, 7, 6)).astype(np.float32)
    return net, tokens, image


@pytest.mark.slow  # 8 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_flax_model_gives_the_torch_outputs():
    net, tokens, image = _net_and_inputs()
    maps = layer_maps(net, NAMES)
    assert {m.kind for m in maps} == {"embedding", "layernorm", "linear", "conv"}
    params = torch_to_flax(net.state_dict(), maps)
    reference = FlaxNet().init(jax.random.key(0), tokens, image)["params"]
    assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, reference)
    got = FlaxNet().apply({"params": params}, tokens, image)
    with torch.no_grad():
        want = net(torch.from_numpy(tokens), torch.from_numpy(image)).numpy()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_round_trip_is_exact_and_loads_into_torch():
    net, tokens, image = _net_and_inputs()
    maps = layer_maps(net, NAMES)
    flax_params = FlaxNet().init(jax.random.key(3), tokens, image)["params"]
    sd = flax_to_torch(flax_params, maps)
    fresh = TorchNet().eval()
    fresh.load_state_dict(sd, strict=True)
    with torch.no_grad():
        want = fresh(torch.from_numpy(tokens), torch.from_numpy(image)).numpy()
    np.testing.assert_allclose(np.asarray(FlaxNet().apply({"params": flax_params}, tokens, image)), want, atol=1e-5)
    back = torch_to_flax(sd, maps)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), flax_params, back)
    original = net.state_dict()
    again = flax_to_torch(torch_to_flax(original, maps), maps)
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], original[k]) for k in original)


def test_bf16_weights_keep_their_dtype():
    lin = torch.nn.Linear(4, 2).to(torch.bfloat16)
    maps = (LayerMap("", ("Dense_0",), "linear"),)
    params = torch_to_flax(lin.state_dict(), maps)
    assert params["Dense_0"]["kernel"].dtype.name == "bfloat16"
    sd = flax_to_torch(params, maps)
    assert torch.equal(sd["weight"], lin.weight.detach())


def test_refusals_name_every_problem():
    bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2), torch.nn.GRU(2, 2))
    with pytest.raises(BridgeError, match="BatchNorm1d") as err:
        layer_maps(bn)
    assert "GRU" in str(err.value)
    with pytest.raises(BridgeError, match="no Flax path"):
        layer_maps(TorchNet(), {"embed": "embed"})
    maps = (LayerMap("0", ("Dense_0",), "linear"),)
    sd = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).state_dict()
    with pytest.raises(BridgeError, match=r"no LayerMap covers: \['1.bias', '1.weight'\]"):
        torch_to_flax(sd, maps)
    with pytest.raises(BridgeError, match="Dense_0: missing"):
        flax_to_torch({"Other": {}}, maps)
    with pytest.raises(BridgeError, match="expected kind"):
        LayerMap("x", ("x",), "lstm")
