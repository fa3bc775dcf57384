"""The `openhosti` command on tiny configurations: exit codes, run-dir files, figures, benchmark JSON."""

import json
import statistics
import subprocess
import sys

import jax
import pytest

from openhosti_jax.cli import main
from openhosti_jax.models.gpt import GPTConfig
from openhosti_jax.train import read_metrics

mpimg = pytest.importorskip("matplotlib.image")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    rc = main(
        [
            "train",
            "--steps",
            "4",
            "--batch",
            "16",
            "--seq-len",
            "16",
            "--d-model",
            "32",
            "--plan",
            "fsdp",
            "--run-dir",
            str(d),
            "--checkpoint",
            "--checkpoint-every",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0
    return d


@pytest.mark.parametrize("cmd", ["train", "plan", "report", "bench", "launch", "run"])
def test_help_documents_exit_codes(cmd, capsys):
    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert "exit codes" in out and "2    usage error" in out


@pytest.mark.slow  # 10 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(60)
def test_console_script_help_and_usage_errors():
    ok = subprocess.run(
        [sys.executable, "-m", "openhosti_jax.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0 and "report" in ok.stdout
    assert main(["train", "--no-such-flag"]) == 2
    assert main(["bench", "no-such-benchmark"]) == 2
    assert main(["launch", "-n", "2"]) == 2  # no command after --
    assert main(["report", "/nonexistent/run"]) == 2


@pytest.mark.slow  # 43 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
def test_train_writes_run_dir(run_dir):
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert "ShardingPlan" in (run_dir / "plan.txt").read_text()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["mesh"]["fsdp"] == 8 and plan["zero_stage"] == 3
    mem = plan["memory"]
    assert len(mem["per_device"]) == 8
    # predicted from specs == bytes actually resident in each device's shards (independent measurement)
    for row in mem["per_device"]:
        assert row["params"] == mem["predicted"]["params"]
        assert row["opt_state"] == mem["predicted"]["optimizer"]
    total_bytes = 4 * GPTConfig.tiny(seq_len=16, d_model=32).num_params()
    assert sum(r["params"] for r in mem["per_device"]) >= total_bytes  # float32: every parameter lives somewhere
    assert mem["compiled"]["argument"] > 0
    saves = read_metrics(run_dir / "checkpoints.jsonl")
    assert [s["step"] for s in saves] == [2, 4] and all(s["blocking_s"] > 0 for s in saves)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


@pytest.mark.timeout(300)
@pytest.mark.slow  # its fixture trains the demo (43 s)
def test_report_pngs_and_numbers_match_metrics(run_dir, capsys):
    rc = main(["report", str(run_dir), "--schedule", "gpipe", "--stages", "4", "--microbatches", "8"])
    assert rc == 0
    out_dir = run_dir / "report"
    for name in ("loss", "throughput", "memory", "pipeline"):
        assert mpimg.imread(out_dir / f"{name}.png").shape[:2] == (450, 800)
    assert "skipped balance" in capsys.readouterr().out
    summary = json.loads((out_dir / "report.json").read_text())["summary"]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert summary["first_loss"] == metrics[0]["loss"] and summary["final_loss"] == metrics[-1]["loss"]
    assert summary["median_step_time_s"] == statistics.median(m["step_time_s"] for m in metrics[1:])
    assert summary["mesh"]["fsdp"] == 8


@pytest.mark.slow  # 9 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(120)
def test_plan_example_prints_report(capsys):
    assert main(["plan", "--example", "gpt"]) == 0
    assert "ShardingPlan" in capsys.readouterr().out


@pytest.mark.slow  # runs the CLI's child process
@pytest.mark.timeout(60)
def test_run_passes_exit_code_through():
    assert main(["run", "--max-restarts", "0", "--", sys.executable, "-c", "pass"]) == 0
    assert main(["run", "--max-restarts", "0", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 1


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_gpu_mfu_dry_run(capfd):
    assert main(["bench", "gpu_mfu", "--dry-run", "--repeats", "1"]) == 0
    res = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    for key in ("mfu", "plain_jit_mfu", "tokens_per_s", "peak_memory_bytes"):
        assert res[key] is not None and res[key] > 0
    cfg = GPTConfig.tiny(dtype="bfloat16")
    assert res["params"] == cfg.num_params() and res["flops_per_token"] == cfg.flops_per_token()
    assert res["devices"] == jax.device_count()
    tps = res["global_batch"] * res["seq_len"] / statistics.median(res["step_times_s"])
    assert res["tokens_per_s"] == pytest.approx(tps)
    assert res["mfu"] == pytest.approx(tps * res["flops_per_token"] / (res["devices"] * res["peak_flops_per_device"]))


_LLAMA = ["--model", "llama3-8b", "--global-batch", "8"]
BAD_LINES = [
    ["train", "--lr", "nan"],
    ["train", "--lr", "-1"],
    ["train", "--steps", "0"],
    ["train", "--batch", "abc"],
    ["train", "--devices", "100000"],
    ["plan", "--devices", "0"],
    ["plan", "--memory-budget", "-5"],
    ["plan", "--devices", "x"],
    ["plan", "--example", "nosuch"],
    ["plan", "--devices", "100000"],
    ["predict", "--cluster", "8000000000000000000000xH100", *_LLAMA],
    ["predict", "--cluster", "0xH100", *_LLAMA],
    ["predict", "--cluster", "99999x99999xH100", *_LLAMA],
    ["predict", "--cluster", "8xH100", "--model", "llama3-8b", "--global-batch", "²"],
    ["predict", "--cluster", "8xH100", *_LLAMA, "--seq", "0"],
    ["predict", "--cluster", "8xH100", *_LLAMA, "--layers", "4"],
    ["predict", "--cluster", "8xH100", *_LLAMA, "--zero", "2"],
    ["predict", "--cluster", "8xH100", *_LLAMA, "--memory-budget", "nan"],
    ["report", "/nonexistent/run"],
    ["report", "RUN", "--stages", "0"],
    ["report", "RUN_BAD_JSON"],
    ["report", "RUN_BAD_FIELD"],
    ["bench", "../x"],
    ["bench", "/tmp/x"],
    ["bench", "goals"],
    ["bench", "checkpoint/../planner"],
    ["launch", "-n", "0", "--", "true"],
    ["launch", "-n", "2"],
    ["launch", "-n", "2", "--port", "70000", "--", "true"],
    ["launch", "-n", "100000", "--", "true"],
    ["launch", "-n", "2", "--local-devices", "0", "--", "true"],
    ["run", "--max-backoff-s", "nan", "--", "true"],
    ["run", "--backoff-s", "-1", "--", "true"],
    ["run", "--max-restarts", "-1", "--", "true"],
    ["run", "--backoff-factor", "0.5", "--", "true"],
    ["run", "--reset-after-s", "0", "--", "true"],
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line", BAD_LINES, ids=lambda line: " ".join(line)[:60])
def test_a_malformed_command_line_gets_a_one_line_typed_error_and_a_failing_exit(line, tmp_path, capsys):
    runs = {
        "RUN": "{}\n",
        "RUN_BAD_JSON": '{"step": 1, "loss": 2.0}\n{"step": 2, "lo',
        "RUN_BAD_FIELD": '{"loss": "y"}\n',
    }
    for i, word in enumerate(line):
        if word in runs:
            (tmp_path / word).mkdir()
            (tmp_path / word / "metrics.jsonl").write_text(runs[word])
            line = [*line[:i], str(tmp_path / word), *line[i + 1 :]]
    assert main(line) in (1, 2)  # no exception escapes main, nothing hangs (the timeout), nothing starts
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"openhosti {line[0]}: ") or err[-1].startswith("openhosti: error:"), err[-1]
