"""DDP's gradient accumulation through `OptimizedDDP`: ``no_sync()`` and ``require_backward_grad_sync``, the
gradients summed into ``param.grad`` as torch sums them, one cross-process reduction per window. On one process
against plain torch; over 2 processes (started as torchrun starts them) against torch's DDP on gloo, counting the
reductions. Run as a script, this file is one worker of the 2-process test.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch  # needs the torch extra
torch = pytest.importorskip("torch")

from openhosti_jax.errors import BridgeError  # noqa: E402
from openhosti_jax.frontends.torch_ddp import OptimizedDDP  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOWS, MICRO = 3, 3


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(rank=0, rows=8):
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(WINDOWS * MICRO)]


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y) / MICRO  # as torch's accumulation recipe divides it


def accumulate(model, data, form):
    """torch's documented loop: ``no_sync()`` (or nanoGPT's flag) for every micro step but a window's last."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads_mid = None
    for i, (x, y) in enumerate(data):
        last = (i + 1) % MICRO == 0
        if form == "plain" or last:
            if form == "flag":
                model.require_backward_grad_sync = True
            loss_fn(model(x), y).backward()
        elif form == "no_sync":
            with model.no_sync():
                loss_fn(model(x), y).backward()
        else:
            model.require_backward_grad_sync = False
            loss_fn(model(x), y).backward()
        if i == MICRO - 2:  # inside the first window: what param.grad holds so far
            grads_mid = [p.grad.clone() for p in model.parameters()]
        if last:
            opt.step()
            opt.zero_grad()
    return grads_mid


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["no_sync", "flag"])
def test_accumulation_windows_sum_into_param_grad_as_torch_and_sync_once_per_window(form):
    reference, ours = mlp(), OptimizedDDP(mlp())
    ref_mid = accumulate(reference, batches(), "plain")
    mid = accumulate(ours, batches(), form)
    for a, b in zip(mid, ref_mid, strict=True):  # partial sums inside the window, as torch accumulates them
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours.gradient_syncs == WINDOWS  # one per window, not one per backward (9)


def test_no_sync_entered_twice_and_train_step_inside_it_are_typed_errors():
    model = OptimizedDDP(mlp())
    with model.no_sync():
        with pytest.raises(BridgeError, match=r"no_sync\(\) entered twice: expected one no_sync\(\) per"):
            with model.no_sync():
                pass
        assert model.require_backward_grad_sync is False
    assert model.require_backward_grad_sync is True  # restored on the way out
    module = mlp()
    full = OptimizedDDP(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), criterion=loss_fn)
    with full.no_sync(), pytest.raises(BridgeError, match=r"found it inside; accumulate in the full mode"):
        full.train_step(*batches()[0])


def worker() -> None:
    import numpy as np
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    reference = torch.nn.parallel.DistributedDataParallel(mlp())
    ours = OptimizedDDP(mlp())
    data = batches(rank)
    ref_mid = accumulate(reference, data, "no_sync")
    mid = accumulate(ours, data, "no_sync")
    flag = OptimizedDDP(mlp())
    accumulate(flag, data, "flag")
    plain = OptimizedDDP(mlp())
    accumulate(plain, data, "plain")  # no window: every backward reduces

    def diff(a, b):
        return max(float(np.abs(x.detach().numpy() - y.detach().numpy()).max()) for x, y in zip(a, b, strict=True))

    result = {
        "rank": rank,
        "param_diff": diff(ours.module.parameters(), reference.module.parameters()),
        "flag_param_diff": diff(flag.module.parameters(), reference.module.parameters()),
        "plain_param_diff": diff(plain.module.parameters(), reference.module.parameters()),
        "mid_diff": diff(mid, ref_mid),  # inside a window: this process's own gradients, unreduced
        "mid": [float(t.sum()) for t in mid],
        "syncs": ours.gradient_syncs,
        "flag_syncs": flag.gradient_syncs,
        "plain_syncs": plain.gradient_syncs,
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


@pytest.mark.slow  # two processes, each compiling the local and the global programs: ~30 s on 2 loaded cores
@pytest.mark.timeout(300)
def test_two_processes_reduce_once_per_window_and_match_torch_ddp_over_gloo():
    from test_bridges_torch_ddp_multiprocess import _two_free_ports

    port = _two_free_ports()
    base = {k: v for k, v in os.environ.items() if not k.startswith("OPENHOSTI_")}
    procs = []
    for rank in range(2):
        env = {
            **base,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "PYTHONPATH": ROOT + os.pathsep + base.get("PYTHONPATH", ""),
        }
        cmd = [sys.executable, os.path.abspath(__file__)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    results = {}
    for text in outs:
        for line in text.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r["rank"]] = r
    assert set(results) == {0, 1}, "\n".join(o[-3000:] for o in outs)
    for r in results.values():
        assert max(r["param_diff"], r["flag_param_diff"], r["plain_param_diff"]) < 1e-5, r  # DDP's, 3 windows on
        assert r["mid_diff"] < 1e-6, r  # param.grad inside a window: the process's own sum, as DDP's
        assert r["syncs"] == r["flag_syncs"] == WINDOWS, r  # one reduction per window
        assert r["plain_syncs"] == WINDOWS * MICRO, r  # without a window, every backward reduces
    assert results[0]["mid"] != results[1]["mid"]  # unreduced inside the window: each rank's own


if __name__ == "__main__":
    worker()
