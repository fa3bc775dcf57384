"""OptimizedDDP against torch's DistributedDataParallel over 2 processes started as torchrun starts them
(``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE``): the same losses on every rank, the same parameters,
in the drop-in mode and in the full mode, a short last batch included.

Run as a script, this file is one worker.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch  # needs the torch extra

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker() -> None:
    import copy

    import numpy as np
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_bridges_torch_ddp import TinyGPT, _loss, _train

    from openhosti_jax.frontends.torch_ddp import OptimizedDDP

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(rank)  # different starting weights per rank: both wrappers broadcast rank 0's
    model = TinyGPT()
    ours, full_model = copy.deepcopy(model), copy.deepcopy(model)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    batches = [  # the last one short, as a DataLoader's: 3 rows on each process's 2 devices
        (torch.randint(0, 64, (rows, 12), generator=g), torch.randint(0, 64, (rows, 12), generator=g))
        for rows in (4, 4, 4, 4, 4, 3)
    ]
    make = lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9)  # noqa: E731
    torch_losses = _train(torch.nn.parallel.DistributedDataParallel(model), make, batches, steps=6)
    our_losses = _train(OptimizedDDP(ours), make, batches, steps=6)
    full = OptimizedDDP(full_model, optimizer=make(full_model.parameters()), criterion=_loss)
    full_losses = [float(full.train_step(x, y)) for x, y in batches]  # the loss of the global batch
    full.state_dict()

    def diff(other: torch.nn.Module) -> float:
        return max(
            float(np.abs(a.detach().numpy() - b.detach().numpy()).max())
            for a, b in zip(model.parameters(), other.parameters(), strict=True)
        )

    result = {
        "rank": rank,
        "torch": torch_losses,
        "ours": our_losses,
        "full": full_losses,
        "param_diff": diff(ours),
        "full_param_diff": diff(full_model),
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _two_free_ports() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two adjacent free ports")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_match_torch_ddp():
    pytest.importorskip("torch")
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
        assert r["torch"] == pytest.approx(r["ours"], rel=1e-5)
        assert r["param_diff"] < 1e-5
        assert r["full_param_diff"] < 1e-5  # the full mode (ZeRO-3 over both processes' devices) as DDP
        # each rank's DDP loss is its own batch's; the full mode's is the global batch's: their mean
        mean = [(a + b) / 2 for a, b in zip(results[0]["torch"], results[1]["torch"], strict=True)]
        assert r["full"] == pytest.approx(mean, rel=1e-5)
    assert results[0]["torch"] != results[1]["torch"]  # each rank trained on its own batches


if __name__ == "__main__":
    worker()
