"""Cluster launchers start `jax.distributed`: torchrun, SLURM (srun), Open MPI (mpirun) and a Kubernetes JobSet.

Each launcher's environment is simulated on 127.0.0.1 for 2 processes of 2 CPU devices (`launcher_env`), and
``examples/cluster_gpt.py`` (what ``examples/slurm/train_gpt.sbatch`` and ``examples/k8s/jobset.yaml`` run) trains
to its last step in both. How each simulation stays honest on loopback:

* torchrun: exactly its variables, MASTER_ADDR=127.0.0.1.
* SLURM: jax's own SlurmCluster finds the coordinator: the first host of SLURM_STEP_NODELIST (here ``localhost``,
  the one node of a one-node step; a bracketed list would need no ``scontrol``: jax parses it) and the port
  ``61440 + SLURM_JOB_ID % 4096``, so the job id is chosen to give a free port.
* Open MPI: jax's own OmpiCluster reads mpirun's address (127.0.0.1) from OMPI_MCA_orte_hnp_uri and the port from
  its job id, chosen the same way; no mpirun daemon is needed for that.
* JobSet: the variables the manifest sets, with 127.0.0.1 for pod 0's DNS name, and JOB_COMPLETION_INDEX, which
  the Job controller sets, as the rank.
"""

import io
import json
import os
import subprocess
import sys

import pytest

from openhosti_jax.errors import ConfigError, DistributedError
from openhosti_jax.mesh.distributed import LaunchInfo, detect_launch
from openhosti_jax.mesh.launch import DERIVED_PORTS, LAUNCHERS, launch_local, launcher_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "cluster_gpt.py")
SBATCH = os.path.join(ROOT, "examples", "slurm", "train_gpt.sbatch")
FAKE_SRUN = """#!{python}
# srun for one node: SLURM_NTASKS tasks with the variables srun gives them; the first failure ends them all
# (--kill-on-bad-exit=1). Its own options are ignored.
import os, sys
from openhosti_jax.mesh.launch import launch_local
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
sys.exit(launch_local(args, int(os.environ["SLURM_NTASKS"]), local_devices=2, launcher="slurm", kill_grace_s=2))
"""
FAKE_OPENHOSTI = """#!{python}
import sys
from openhosti_jax.cli import main
sys.exit(main())
"""
TINY = ["--steps", "2", "--batch", "8", "--sequences", "64", "--d-model", "32", "--layers", "1", "--seq-len", "16"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_simulated_environment_is_detected_as_its_launcher_with_the_rank_and_count(launcher):
    found = [detect_launch(launcher_env(launcher, i, 3, 61500)) for i in range(3)]
    assert [(f.launcher, f.num_processes, f.process_id) for f in found] == [(launcher, 3, i) for i in range(3)]
    coordinators = {f.coordinator_address for f in found}
    want = {"torchrun": "127.0.0.1:61500", "openhosti": "127.0.0.1:61500", "jobset": "127.0.0.1:61500"}
    assert coordinators == {want.get(launcher)}  # SLURM, Open MPI: None, jax derives it


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
@pytest.mark.parametrize("port", [DERIVED_PORTS[0], 61500, DERIVED_PORTS[1], 12345])
def test_jax_derives_the_chosen_coordinator_from_the_simulated_slurm_and_openmpi_variables(monkeypatch, launcher, port):
    from jax._src.clusters import OmpiCluster, SlurmCluster  # the detectors jax.distributed.initialize runs

    cluster = {"slurm": SlurmCluster, "openmpi": OmpiCluster}[launcher]
    env = launcher_env(launcher, 1, 2, port)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cluster.is_env_present()
    override = env.get("JAX_COORDINATOR_PORT")  # only outside the derivable range
    assert (override is None) == (DERIVED_PORTS[0] <= port <= DERIVED_PORTS[1])
    host = {"slurm": "localhost", "openmpi": "127.0.0.1"}[launcher]
    assert cluster.get_coordinator_address(None, override) == f"{host}:{port}"
    assert (cluster.get_process_count(), cluster.get_process_id(), cluster.get_local_process_id()) == (2, 1, 1)


def test_slurm_nodelists_of_real_clusters_give_the_first_node():
    env = {"SLURM_JOB_ID": "4097", "SLURM_NTASKS": "16", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}
    assert detect_launch({**env, "SLURM_STEP_NODELIST": "gpu[07-08]"}) == LaunchInfo("slurm", None, 16, 3)
    assert detect_launch(env) is None  # the batch script itself (no srun step): one process, nothing to join


def test_precedence_and_rank_sources():
    torch = launcher_env("torchrun", 1, 2, 29501)
    slurm = launcher_env("slurm", 5, 8, 61500)
    # torchrun inside a SLURM allocation: torchrun's ranks win
    assert detect_launch({**slurm, **torch}).launcher == "torchrun"
    # openhosti's own variables win over everything
    assert detect_launch({**slurm, **launcher_env("openhosti", 0, 4, 9)}) == LaunchInfo(
        "openhosti", "127.0.0.1:9", 4, 0
    )
    # a coordinator with an Open MPI 5 rank (no HNP URI), or a SLURM rank
    ompi5 = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "JAX_COORDINATOR_ADDRESS": "n0:7000"}
    assert detect_launch(ompi5) == LaunchInfo("openmpi", "n0:7000", 4, 2)
    assert detect_launch({**slurm, "OPENHOSTI_COORDINATOR": "n0:1"}) == LaunchInfo("slurm", "n0:1", 8, 5)
    # an Indexed Job without OPENHOSTI_NUM_PROCESSES has a rank but no count
    assert detect_launch({"OPENHOSTI_COORDINATOR": "a:1", "JOB_COMPLETION_INDEX": "1"}).num_processes is None
    assert detect_launch({"TPU_WORKER_HOSTNAMES": "a,b"}) == LaunchInfo("jax", None, None, None)
    assert detect_launch({"PATH": "/bin"}) is None


def test_bad_values_and_incomplete_coordinates_raise_typed_errors(monkeypatch):
    from openhosti_jax.mesh import initialize_distributed

    with pytest.raises(DistributedError, match="SLURM_PROCID"):
        detect_launch({**launcher_env("slurm", 0, 2, 61500), "SLURM_PROCID": "zero"})
    monkeypatch.setenv("OPENHOSTI_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    with pytest.raises(DistributedError, match="expected both"):
        initialize_distributed()
    with pytest.raises(ConfigError, match="launcher"):
        launcher_env("pbs", 0, 2, 1)


@pytest.mark.parametrize("env", [launcher_env("slurm", 0, 1, 61500), launcher_env("torchrun", 0, 1, 29501)])
def test_a_launcher_with_one_process_is_a_single_process_run(monkeypatch, env):
    from openhosti_jax.mesh import initialize_distributed

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert initialize_distributed() is False


def test_the_jobset_manifest_sets_what_the_simulation_sets():
    yaml = pytest.importorskip("yaml")
    with open(os.path.join(ROOT, "examples", "k8s", "jobset.yaml")) as f:
        js = yaml.safe_load(f)
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    (rjob,) = js["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert rjob["replicas"] == 1 and job["completionMode"] == "Indexed"  # the Job controller sets the rank
    (container,) = job["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    n = int(env["OPENHOSTI_NUM_PROCESSES"]["value"])
    assert job["parallelism"] == job["completions"] == n
    label = env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert label == "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    coordinator = env["OPENHOSTI_COORDINATOR"]["value"]
    port = int(coordinator.rsplit(":", 1)[1])
    assert coordinator == f"$(JOBSET_NAME)-{rjob['name']}-0-0.$(JOBSET_NAME):{port}"  # pod 0 of job 0
    assert list(env).index("JOBSET_NAME") < list(env).index("OPENHOSTI_COORDINATOR")  # $(..) needs it defined first
    assert {p["containerPort"] for p in container["ports"]} == {port}
    simulated = launcher_env("jobset", 1, n, port)
    assert set(simulated) - {"JOB_COMPLETION_INDEX"} <= set(env)
    cmd = container["command"]
    assert cmd[:2] == ["openhosti", "run"] and cmd[cmd.index("--") + 1 :][:2] == ["python", "examples/cluster_gpt.py"]
    backoff = float(next(a.split("=")[1] for a in cmd if a.startswith("--backoff-s")))
    assert backoff > float(env["OPENHOSTI_HEARTBEAT_TIMEOUT_S"]["value"])  # the old coordinator is gone first
    assert job["backoffLimit"] == 0 and js["spec"]["failurePolicy"]["maxRestarts"] >= 1


def test_the_slurm_script_supervises_srun_with_kill_on_bad_exit():
    with open(os.path.join(ROOT, "examples", "slurm", "train_gpt.sbatch")) as f:
        text = f.read()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines()]
    (launch,) = [ln for ln in lines if ln.startswith("exec openhosti run")]
    words = launch.split()
    srun = words.index("srun")
    assert words[words.index("--") + 1] == "srun" and "--kill-on-bad-exit=1" in words[srun:]
    assert words[words.index("python", srun) + 1] == "examples/cluster_gpt.py"
    assert "#SBATCH --ntasks-per-node=8" in lines and "#SBATCH --gpus-per-node=8" in lines  # a task per GPU
    assert not any("--gpus-per-task" in ln for ln in lines if ln.startswith("#SBATCH"))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "openmpi", "jobset"])
def test_two_processes_started_the_way_the_launcher_starts_them_train_together(tmp_path, launcher):
    log = io.StringIO()
    cmd = [sys.executable, EXAMPLE, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1", *TINY]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc = launch_local(cmd, 2, local_devices=2, launcher=launcher, env=env, timeout_s=200, kill_grace_s=2, output=log)
    text = log.getvalue()
    assert rc == 0, text[-4000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]
    assert sorted(r["process"] for r in results) == [0, 1], text[-4000:]
    for r in results:
        assert (r["launcher"], r["process_count"], r["device_count"], r["start"]) == (launcher, 2, 4, 0)
        assert len(r["losses"]) == 2 and r["losses"][1] < r["losses"][0]
    assert results[0]["losses"] == results[1]["losses"]  # one SPMD program: both see the same global loss
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]  # both steps committed, from both processes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_slurm_batch_script_runs_its_supervised_srun_step_to_the_end(tmp_path):
    """The batch script itself, with ``srun`` (and ``openhosti``, from this checkout) replaced by one-node stand-ins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("openhosti", FAKE_OPENHOSTI)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OPENHOSTI_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        SLURM_JOB_ID="4242",  # what sbatch sets in the batch script's own environment
        SLURM_JOB_NAME="openhosti-gpt",
        SLURM_NTASKS="2",
        CKPT_DIR=str(tmp_path / "ckpt"),
        TRAIN_ARGS=" ".join([*TINY, "--checkpoint-every", "1", "--cpu-devices", "2"]),
    )
    run = subprocess.run(["bash", SBATCH], cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    results = [json.loads(x.split("RESULT ", 1)[1]) for x in run.stdout.splitlines() if "RESULT " in x]
    assert sorted(r["process"] for r in results) == [0, 1], run.stdout[-3000:]
    assert all((r["launcher"], r["process_count"], len(r["losses"])) == ("slurm", 2, 2) for r in results)
    assert results[0]["losses"] == results[1]["losses"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]
