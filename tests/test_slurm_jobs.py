"""The slurm/ scripts on a real single-node Slurm cluster (slurmctld + slurmd + munge, started by
tests/slurm_cluster.py): srun ranks, a too-small job, conversion, the colocated quickstart, a
preempted job that requeues and resumes, and the disaggregated script with a real vLLM server."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from serving_model import make_served_model, make_tp2_model
from slurm_cluster import SlurmCluster, missing_binaries

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"
QUICKSTART = REPO / "examples" / "quickstart.yaml"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    bool(missing_binaries()) or os.geteuid() != 0,
    reason="needs Debian's slurm-wlm and munge (.ci/setup-slurm.sh) and root")


@pytest.fixture(scope="module")
def cluster():
    # Not under pytest's tmp: munged (user munge) must traverse the folder to its socket.
    root = Path(tempfile.mkdtemp(prefix="me-slurm-"))
    root.chmod(0o755)
    c = SlurmCluster(root, cpus=8).start()
    yield c
    c.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def job_env(cluster):
    # One thread per rank: the machine has 2 cores for a 2-task trainer (and maybe a server).
    return cluster.env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """Tiny Qwen2, 4 heads / 2 KV heads (TP=2 works), with a BPE tokenizer."""
    return make_tp2_model(tmp_path_factory.mktemp("tiny"))


def tiny_config(path: Path, model: Path, runs: Path, name: str, **sections) -> Path:
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 2},
        "rollout": {"n_samples": 4, "max_new_tokens": 12, "max_prompt_tokens": 96},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False},
        "trainer": {"steps": 3, "lr": 1e-3, "micro_batch_tokens": 400},
        "logging": {"name": name, "runs_dir": str(runs), "progress_bar": False},
        "cluster": {"gpus_per_node": 2},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path.write_text(yaml.safe_dump(cfg))
    return path


def metrics(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


def assert_finite(rows: list[dict]) -> None:
    for r in rows:
        bad = {k: v for k, v in r.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
        assert not bad, bad


def job_output(tmp: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp.glob("slurm-*.out")))


def port_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# --------------------------------------------------------------------------------------- basics


def test_srun_tasks_see_their_rank_and_the_jobs_master(cluster, job_env, tmp_path):
    script = tmp_path / "ranks.sbatch"
    script.write_text("#!/bin/bash\nsrun python -c 'from megatron_entropy.runtime import "
                      "detect_launch_env as d; e = d(); print(\"RANK\", e.rank, e.world_size, "
                      "e.local_rank, e.master_addr, e.master_port, e.launcher)'\n")
    job, rc = cluster.sbatch("--nodes=1", "--ntasks=2", f"--output={tmp_path}/out.txt",
                             str(script), env=job_env)
    out = (tmp_path / "out.txt").read_text()
    assert rc == 0, out
    rows = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("RANK"))
    port = str(20000 + job % 20000)
    assert rows == [["0", "2", "0", cluster.host, port, "slurm"],
                    ["1", "2", "1", cluster.host, port, "slurm"]]


def test_job_with_too_few_nodes_fails_with_the_count_it_needs(cluster, job_env, tiny_model,
                                                              tmp_path):
    conf = tiny_config(tmp_path / "c.yaml", tiny_model, tmp_path / "runs", "few",
                       rollout={"engine": "vllm", "server": {"urls_file": "urls.txt"}},
                       cluster={"server_nodes": 1})
    _, rc = cluster.sbatch("--nodes=1", "--ntasks=3", str(SLURM / "disaggregated.sbatch"),
                           str(conf), env=job_env, cwd=tmp_path)
    out = job_output(tmp_path)
    assert rc != 0
    assert "the job has 1 node" in out and "needs 2: 1 for rollout servers" in out, out
    assert not (tmp_path / "runs" / "few" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_conversion_job_writes_a_checkpoint_of_the_model(cluster, job_env, tiny_model, tmp_path):
    from megatron_entropy.models.arch import load_arch
    from megatron_entropy.models.megatron_checkpoint import read_arch

    out = tmp_path / "mcore"
    _, rc = cluster.sbatch(str(SLURM / "convert.sbatch"), str(tiny_model), str(out), "2", "1",
                           "--quiet", env=job_env, cwd=tmp_path)
    assert rc == 0, job_output(tmp_path)
    assert read_arch(out) == load_arch(tiny_model)
    assert f"set model.megatron_ckpt={out}" in job_output(tmp_path)


# --------------------------------------------------------------------------------------- training


@pytest.mark.slow
def test_colocated_script_runs_the_quickstart_on_two_tasks(cluster, job_env, tmp_path):
    _, rc = cluster.sbatch(
        "--nodes=1", "--ntasks=2", str(SLURM / "colocated.sbatch"), str(QUICKSTART),
        "cluster.gpus_per_node=2", "trainer.steps=2", "data.prompts_per_step=4",
        "trainer.val_before_train=false", "trainer.val_interval=0",
        f"model.hf_path={REPO / 'examples' / 'quickstart_model'}",
        f"logging.runs_dir={tmp_path / 'runs'}", "logging.name=quick",
        env=job_env, cwd=tmp_path, timeout=900)
    run = tmp_path / "runs" / "quick"
    assert rc == 0, job_output(tmp_path) + (run / "logs" / "trainer.log").read_text()[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows)
    # Both tasks are ranks of one job: the quickstart's TP=2 cannot run on fewer.
    assert yaml.safe_load((run / "config.yaml").read_text())["parallel"]["tensor"] == 2
    assert "trainer: 2 tasks" in job_output(tmp_path)


@pytest.mark.slow
def test_usr1_checkpoints_requeues_and_the_metrics_continue(cluster, job_env, tiny_model,
                                                            tmp_path):
    steps = 5
    conf = tiny_config(tmp_path / "c.yaml", tiny_model, tmp_path / "runs", "pre",
                       trainer={"steps": steps})
    run = tmp_path / "runs" / "pre"
    job = cluster.submit("--nodes=1", "--ntasks=2", str(SLURM / "colocated.sbatch"), str(conf),
                         env=job_env, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not metrics(run):  # the trainer is past step 1: its signal handler is in place
        info = cluster.job(job)
        assert info["JobState"] in ("PENDING", "RUNNING"), (info, job_output(tmp_path))
        assert time.monotonic() < deadline, job_output(tmp_path)
        time.sleep(0.2)
    # What --signal=B:USR1@N does before a time limit: signal the batch script alone.
    cluster.run("scancel", "--signal=USR1", "--batch", str(job))
    info = cluster.wait_state(job, ("PENDING", "REQUEUED", "COMPLETED", "FAILED"), timeout=300)
    done_before_requeue = len(metrics(run))
    info = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=600)
    out = job_output(tmp_path)
    log = (run / "logs" / "trainer.log").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out + log[-3000:]
    assert info["Restarts"] == "1"
    assert "preempted: checkpoint written; requeueing" in out
    assert "resumed from" in log
    assert done_before_requeue < steps
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once, in order
    assert_finite(rows)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (.ci/setup-vllm.sh)")
def test_disaggregated_script_with_a_vllm_server(cluster, job_env, tmp_path):
    model = make_served_model(tmp_path / "model")  # head_dim 64, 1 KV head: TP=1, DP=2
    port = 31700
    conf = tiny_config(
        tmp_path / "c.yaml", model, tmp_path / "runs", "dis", parallel={"tensor": 1},
        trainer={"steps": 2},
        rollout={"engine": "vllm", "server": {
            "urls_file": str(tmp_path / "runs" / "dis" / "server_urls.txt"),
            "server_python": str(VLLM_PYTHON), "base_port": port, "max_model_len": 256,
            "extra_args": ["--enforce-eager"], "startup_timeout_s": 400,
            "extra_env": ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind",
                          "HF_HUB_OFFLINE=1"]}})
    _, rc = cluster.sbatch("--nodes=1", "--ntasks=3", str(SLURM / "disaggregated.sbatch"),
                           str(conf), env=job_env, cwd=tmp_path, timeout=900)
    run = tmp_path / "runs" / "dis"
    out = job_output(tmp_path)
    log = (run / "logs" / "trainer.log").read_text() if (run / "logs").is_dir() else ""
    assert rc == 0, out + log[-3000:]
    assert (run / "server_urls.txt").read_text() == f"http://{cluster.host}:{port}\n"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows)
    server_log = (run / "logs" / "server-0.log").read_text()
    assert "POST /v1/completions" in server_log  # the trainer's rollouts went to the server
    assert "stopping the servers" in out and not port_listens(port)


@pytest.mark.slow
def test_failing_trainer_fails_the_job_and_stops_the_servers(cluster, job_env, tiny_model,
                                                             tmp_path):
    # The servers are a real HTTP server answering /health (what the script waits for). The
    # trainer fails fast: TRAINER_SRUN_ARGS starts 3 ranks, which TP=2 does not divide.
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    port = 31800
    conf = tiny_config(
        tmp_path / "c.yaml", tiny_model, tmp_path / "runs", "fail",
        rollout={"engine": "vllm", "server": {
            "urls_file": str(tmp_path / "urls.txt"), "base_port": port, "startup_timeout_s": 60,
            "launch_command": ["{python}", "-m", "http.server", "--bind", "{host}",
                               "--directory", str(tmp_path / "www"), "{port}"]}})
    _, rc = cluster.sbatch("--nodes=1", "--ntasks=4", str(SLURM / "disaggregated.sbatch"),
                           str(conf), env={**job_env, "TRAINER_SRUN_ARGS": "--ntasks=3"},
                           cwd=tmp_path)
    out = job_output(tmp_path)
    assert rc != 0, out
    assert "servers ready" in out and "trainer exited with code 2" in out, out
    assert "world size 3 is not divisible" in (tmp_path / "runs" / "fail" / "logs" /
                                               "trainer.log").read_text()
    assert "stopping the servers" in out and not port_listens(port)
    assert not metrics(tmp_path / "runs" / "fail")
