"""The slurm/ scripts on a real Slurm cluster of 4 fake nodes with 2 fake GPUs each, all on this
machine (slurmctld + one slurmd per node + munge, started by tests/helpers/slurm_cluster.py): srun ranks
across nodes, a too-small job, conversion, the colocated script, the disaggregated split with
the GPUs every step sees, a time-limit warning (USR1) and a real preemption (GraceTime, SIGTERM to
every task) that checkpoint, requeue and continue, a controller that fails a command once, a
server node that dies, the shipped vLLM quickstart as a disaggregated job with a real vLLM
server, a failing trainer."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from serving_model import make_tp2_model
from slurm_cluster import SlurmCluster, missing_binaries

from megatron_entropy.runtime.launch_env import SLURM_MASTER_PORT_BASE, SLURM_MASTER_PORT_SPAN

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "slurm"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
FAKE_SGLANG = Path(__file__).resolve().parents[1] / "helpers" / "fake_sglang_server.py"

pytestmark = pytest.mark.skipif(
    bool(missing_binaries()) or os.geteuid() != 0,
    reason="needs Debian's slurm-wlm and munge (.ci/setup-slurm.sh) and root")


@pytest.fixture(scope="module")
def cluster():
    # Not under pytest's tmp: munged (user munge) must traverse the folder to its socket.
    root = Path(tempfile.mkdtemp(prefix="me-slurm-"))
    root.chmod(0o755)
    c = SlurmCluster(root, nodes=4, cpus=8, gpus=2)
    try:
        yield c.start()
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def job_env(cluster):
    # One thread per rank: the machine has 2 cores for every rank and server of a job.
    return cluster.env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """Tiny Qwen2, 4 heads / 2 KV heads (TP=2 works), with a BPE tokenizer."""
    return make_tp2_model(tmp_path_factory.mktemp("tiny"))


def tiny_config(path: Path, model: Path, runs: Path, name: str, **sections) -> Path:
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 2, "backend": "gloo"},  # CPU jobs say so (no GPU under Slurm)
        "rollout": {"n_samples": 4, "max_new_tokens": 12, "max_prompt_tokens": 96},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        # not the default 20000 problems: each rank would spend ~2.3 s building its dataset
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 256}},
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


def read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def port_listens(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def stops_listening(port: int, host: str, timeout: float = 30) -> bool:
    """The port closes within ``timeout``: a server stopped by its task (SIGINT, then SIGKILL
    after 20 s) or by the death of its task may still be exiting when the job's last process
    with Slurm's environment is gone (servers get a clean environment, so the cluster does not
    list them)."""
    deadline = time.monotonic() + timeout
    while port_listens(port, host):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


# ----------------------------------------------------------------- the four-node disaggregated job


def disaggregated_config(tmp: Path, model: Path, name: str, steps: int, **sections) -> Path:
    """Servers (the strict fake SGLang server, tests/helpers/fake_sglang_server.py) on node1 and node2,
    one per node with both its GPUs; the trainer on node3 and node4, TP=2 inside a node and DP=2
    across them. Each server binds its own node's address, so both may use the same port."""
    request_log = f'{tmp}/requests-"$SLURMD_NODENAME".jsonl'
    serve = ["/bin/sh", "-c",
             f'exec "$0" "$@" --host "$SLURMD_NODENAME" --request-log {request_log}',
             "{python}", str(FAKE_SGLANG), "--model-path", "{model}", "--port", "{port}",
             "--weight-version", "{weight_version}"]
    server = {"urls_file": str(tmp / "runs" / name / "server_urls.txt"), "base_port": 31900,
              "server_python": sys.executable, "launch_command": serve,
              "startup_timeout_s": 300, "health_check_interval_s": 1, "health_timeout_s": 5}
    layout = {"rollout": {"engine": "sglang", "server": server},
              "trainer": {"steps": steps, "save_interval": 1},
              "cluster": {"server_nodes": 2, "servers_per_node": 1, "server_gpus": 2}}
    for section, values in sections.items():
        layout[section] = {**layout.get(section, {}), **values}
    return tiny_config(tmp / "c.yaml", model, tmp / "runs", name, **layout)


def recording_python(tmp: Path) -> Path:
    """A PYTHON for the scripts that logs where each process of the job runs and which GPUs it
    was given, then becomes the real interpreter."""
    wrapper = tmp / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "${{SLURMD_NODENAME:-?}} step=${{SLURM_STEP_ID:-batch}} task=${{SLURM_PROCID:-?}} '
        f'gpus=${{CUDA_VISIBLE_DEVICES:-none}} step_gpus=${{SLURM_STEP_GPUS:-none}} $*" '
        f'>> {tmp}/processes.txt\n'
        f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def failing_once(tmp: Path, *commands: str) -> Path:
    """A bin folder for PATH whose ``squeue`` / ``scontrol SUB`` fail the first time each is
    called, as a busy or restarting controller answers ("Socket timed out"), then work."""
    bin_dir, state = tmp / "bin", tmp / "failed-once"
    bin_dir.mkdir()
    state.mkdir()
    for cmd in commands:
        real = shutil.which(cmd)
        (bin_dir / cmd).write_text(
            "#!/bin/sh\n"
            f'key="{state}/{cmd}-$1"\n'
            'if [ ! -e "$key" ]; then\n'
            '  touch "$key"\n'
            f'  echo "{cmd}: error: Socket timed out on send/recv operation (test)" >&2\n'
            "  exit 1\n"
            "fi\n"
            f'exec {real} "$@"\n')
        (bin_dir / cmd).chmod(0o755)
    return bin_dir


def processes_by_role(tmp: Path) -> dict[str, list[dict]]:
    roles: dict[str, list[dict]] = {"trainer": [], "server": [], "batch": []}
    for line in read(tmp / "processes.txt").splitlines():
        node, step, task, gpus, step_gpus, *argv = line.split()
        row = {"node": node, "step": step.split("=")[1], "task": task.split("=")[1],
               "gpus": gpus.split("=")[1], "step_gpus": step_gpus.split("=")[1]}
        if argv[:3] == ["-m", "megatron_entropy.cli", "train"]:
            roles["trainer"].append(row)
        elif argv[:4] == ["-m", "megatron_entropy.cli", "slurm", "serve"]:
            roles["server"].append(row)
        else:
            roles["batch"].append(row)
    return roles


# States of a job that has not ended: SIGNALING is shown while a preemption's GraceTime signals
# its tasks (seen on a busy machine), CONFIGURING / STAGE_OUT around its start and end.
NOT_ENDED = ("PENDING", "CONFIGURING", "RUNNING", "SIGNALING", "REQUEUED", "COMPLETING",
             "STAGE_OUT")


def wait_for(what: str, condition, cluster: SlurmCluster, job: int, tmp: Path,
             timeout: float = 420) -> dict:
    """Poll until ``condition(job info)`` holds; fail if the job ends first."""
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.job(job)
        if condition(info):
            return info
        assert info["JobState"] in NOT_ENDED, (what, info, job_output(tmp))
        assert time.monotonic() < deadline, (what, info, job_output(tmp))
        time.sleep(0.5)


@pytest.mark.slow
def test_four_node_job_gpus_usr1_and_preemption_checkpoint_requeue_resume(cluster, job_env,
                                                                          tiny_model, tmp_path):
    """One disaggregated job on the four nodes: servers on the first two, the trainer (TP=2 x
    DP=2) on the other two, every step with the GPUs it asked for (the job holds them only
    through --exclusive). It is warned by USR1 (what --signal=B:USR1@600 sends the batch script
    before the time limit): it checkpoints, requeues (squeue and each scontrol subcommand fail
    once) and resumes, its metrics going on. Then it is preempted for real (a job of the
    `urgent` partition needs node3: GraceTime, SIGTERM to every task of every step): it
    checkpoints and requeues again, and waits while the urgent job holds node3. (A third start
    would resume the same way as the second; two starts cover both signals.) save_interval=0:
    every checkpoint is one a stop request wrote."""
    steps = 6
    conf = disaggregated_config(tmp_path, tiny_model, "four", steps,
                                trainer={"steps": steps, "save_interval": 0})
    run = tmp_path / "runs" / "four"
    env = {**job_env, "PYTHON": str(recording_python(tmp_path)),
           "PATH": f"{failing_once(tmp_path, 'squeue', 'scontrol')}:{job_env['PATH']}"}
    job = cluster.submit("--nodes=4", str(SLURM / "disaggregated.sbatch"), str(conf), env=env,
                         cwd=tmp_path)

    def steps_done(n: int):
        return lambda info: len(metrics(run)) >= n

    wait_for("the first step", steps_done(1), cluster, job, tmp_path)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job))
    wait_for("a requeue", lambda info: info.get("Restarts") == "1", cluster, job, tmp_path)
    # The resumed run makes progress, then a real preemption comes.
    wait_for("resume", lambda info: "resumed from" in read(run / "logs" / "trainer.log"),
             cluster, job, tmp_path)
    resumed_at = len(metrics(run))
    wait_for("a step after resuming", steps_done(resumed_at + 1), cluster, job, tmp_path)
    urgent = cluster.submit("--partition=urgent", "--nodes=1", "--nodelist=node3",
                            f"--output={tmp_path}/urgent.out", "--wrap",
                            "echo urgent ran; sleep 600", env=job_env)
    try:
        info = wait_for("the second requeue", lambda info: info.get("Restarts") == "2"
                        and info["JobState"] == "PENDING", cluster, job, tmp_path)
        # PENDING: Slurm has ended every step of the requeued job on every node.
        assert not cluster.left_after_end(job), job_output(tmp_path)[-3000:]
        cluster.wait_state(urgent, ("RUNNING",), timeout=120)  # it runs while ours waits
        deadline = time.monotonic() + 60
        while not read(tmp_path / "urgent.out") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert read(tmp_path / "urgent.out") == "urgent ran\n"
    finally:
        cluster.run("scancel", str(urgent), str(job), check=False)
    out, log = job_output(tmp_path), read(run / "logs" / "trainer.log")

    # The split: servers on node1 and node2, the trainer's four ranks on node3 and node4.
    assert "trainer: 4 tasks on node3,node4 (GPUs per node: 2)" in out, out
    assert "servers: 2 x sglang (2 GPU each) on node1,node2" in out, out
    assert read(run / "server_urls.txt") == "http://node1:31900\nhttp://node2:31900\n"
    roles = processes_by_role(tmp_path)
    assert len(roles["trainer"]) == 8 and len(roles["server"]) == 4, roles  # two starts
    for start in range(2):
        trainers = roles["trainer"][4 * start:4 * start + 4]
        servers = roles["server"][2 * start:2 * start + 2]
        assert sorted((r["node"], r["task"]) for r in trainers) == \
            [("node3", "0"), ("node3", "1"), ("node4", "2"), ("node4", "3")], roles
        assert sorted(r["node"] for r in servers) == ["node1", "node2"], roles
        # Bug 1: each step asked for its GPUs, so each task sees its node's two.
        for r in trainers + servers:
            assert (r["gpus"], r["step_gpus"]) == ("0,1", "0,1"), r
    server_logs = read(run / "logs" / "server-0.log") + read(run / "logs" / "server-1.log")
    # Across nodes a server binds its node's address; node names resolve to loopback addresses
    # on this one machine, so the servers listen on every interface here (the fake server binds
    # its node's name itself).
    assert re.search(r"\[serve 0\] node1:31900 \(listening on 0.0.0.0\) GPUs 0,1", server_logs), \
        server_logs
    assert re.search(r"\[serve 1\] node2:31900 \(listening on 0.0.0.0\) GPUs 0,1", server_logs), \
        server_logs
    # Rollouts went to both servers; each got the new weights.
    for node in ("node1", "node2"):
        paths = [json.loads(line)["path"] for line in
                 read(tmp_path / f"requests-{node}.jsonl").splitlines()]
        assert "/generate" in paths and "/update_weights_from_disk" in paths, (node, paths)

    # USR1: passed on by the script; the requeue is retried once.
    assert "USR1: asking the trainer to checkpoint and stop" in out
    assert re.search(r"scontrol requeue \d+ failed \(attempt 1 of 5\): scontrol: error: Socket "
                     r"timed out", out), out
    # SIGTERM from the preemption: the servers ignored it and kept serving the last step.
    assert "SIGTERM ignored" in server_logs
    assert out.count("preempted: checkpoint written; requeueing") == 2, out
    # (inside a step: abandoned, the last completed step checkpointed; at its end: that step)
    stops = re.findall(r"signal received(?: during step \d \(not applied\))?: checkpointed "
                       r"step (\d); exiting with 75", log)
    assert len(stops) == 2, log[-3000:]
    assert log.count("resumed from") == 1
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), out
    assert int(stops[0]) < int(stops[1]) == len(rows) < steps, (stops, len(rows))
    assert read(run / "checkpoints" / "latest") == f"step_{len(rows):08d}"
    assert_finite(rows)
    assert out.count("stopping the servers") == 2
    assert not port_listens(31900, cluster.address("node1"))


@pytest.mark.slow
def test_a_server_node_that_dies_takes_the_job_down_and_leaves_nothing(cluster, job_env,
                                                                      tiny_model, tmp_path):
    """node2 (a server node) loses power mid-run: its slurmd, step daemons and server die at
    once. The trainer goes on with node1's server until Slurm declares node2 DOWN and requeues
    the job (or the trainer fails first): either way no process of the job is left on any node
    and node1's server no longer listens."""
    # Lighter than the job above: three nodes, one trainer rank (on node3), one GPU per step.
    conf = disaggregated_config(tmp_path, tiny_model, "dies", steps=200,
                                parallel={"tensor": 1}, cluster={"gpus_per_node": 1,
                                                                 "server_gpus": 1})
    run = tmp_path / "runs" / "dies"
    # (node2 named: requeued, the job waits for it instead of starting on node4)
    job = cluster.submit("--nodes=3", "--nodelist=node[1-3]",
                         str(SLURM / "disaggregated.sbatch"), str(conf), env=job_env,
                         cwd=tmp_path)
    try:
        wait_for("the first step", lambda info: len(metrics(run)) >= 1, cluster, job, tmp_path)
        cluster.kill_node("node2")
        steps_at_kill = len(metrics(run))
        deadline = time.monotonic() + 180
        while True:
            info = cluster.job(job)
            if info["JobState"] == "FAILED" or int(info.get("Restarts", 0)) >= 1:
                break
            assert time.monotonic() < deadline, (info, job_output(tmp_path))
            time.sleep(1)
        if info["JobState"] != "FAILED":  # requeued: keep it from starting again
            cluster.run("scontrol", "hold", str(job))
        deadline = time.monotonic() + 60
        while cluster.processes(job_id=job) and time.monotonic() < deadline:
            time.sleep(1)
        out = job_output(tmp_path)
        assert not cluster.processes(job_id=job), out
        assert stops_listening(31900, cluster.address("node1"))
        if info["JobState"] == "FAILED":
            assert "trainer exited with code" in out and "stopping the servers" in out, out
        else:
            assert cluster.node_states()["node2"].startswith("down"), cluster.node_states()
            # Until then the trainer went on with node1's server alone.
            assert len(metrics(run)) > steps_at_kill, (steps_at_kill, out)
            assert "due to failure of node node2" in read(cluster.root / "log" /
                                                           "slurmctld.log")
    finally:
        cluster.run("scancel", str(job), check=False)
        cluster.start_node("node2")


# scontrol requeue as the batch script sees it: it succeeds, or the requeue goes through and
# Slurm's SIGTERM (to the job's whole process tree, the script included) kills scontrol first.
REQUEUE_ANSWERS = {"made": "exit 0", "scontrol killed": 'kill -TERM "$SCRIPT_PID"; exit 143'}


@pytest.mark.parametrize("answer", REQUEUE_ANSWERS)
def test_a_requeued_script_waits_for_its_end_as_one_process(tmp_path, answer):
    """After its own `scontrol requeue` the batch script waits for Slurm to end it as the very
    process Slurm started, with no child: Slurm ends a job by signalling the process tree it
    walks (proctrack/linuxproc), and a child forked meanwhile escapes the SIGTERM that kills its
    parent. Seen on the cluster: 1 requeue in 10 on a busy machine left the script's `sleep 120`
    running as an orphan after the job was PENDING again (the four-node test's lingering
    process). A SIGTERM during the requeue is no failure to retry: the job is ending."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n{REQUEUE_ANSWERS[answer]}\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    script = subprocess.Popen(
        ["bash", "-c", f'export SCRIPT_PID=$$; source "{SLURM / "common.sh"}"; me_requeue'],
        env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        argv = []
        while argv[:1] != ["sleep"] and time.monotonic() < deadline:
            argv = Path(f"/proc/{script.pid}/cmdline").read_text().split("\0")
            time.sleep(0.05)
        assert argv[:2] == ["sleep", "120"], argv  # the script itself waits
        assert not psutil.Process(script.pid).children()
        script.send_signal(signal.SIGTERM)  # what Slurm's requeue sends: it ends the wait
        assert script.wait(timeout=10) == -signal.SIGTERM
        said = script.stdout.read()
        assert ("requeued job 7" if answer == "made" else "SIGTERM: the job is ending") in said
        assert "failed (attempt" not in said, said
    finally:
        script.kill()
        script.wait()


# --------------------------------------------------------------------------------------- basics


def test_srun_tasks_see_their_rank_and_the_jobs_master(cluster, job_env, tmp_path):
    script = tmp_path / "ranks.sbatch"
    script.write_text("#!/bin/bash\necho NODES $(scontrol show hostnames)\n"
                      "srun python -c 'import os; from megatron_entropy.runtime import "
                      "detect_launch_env as d; e = d(); print(\"RANK\", e.rank, e.world_size, "
                      "e.local_rank, os.environ[\"SLURMD_NODENAME\"], e.master_addr, "
                      "e.master_port, e.launcher)'\n")
    job, rc = cluster.sbatch("--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                             f"--output={tmp_path}/out.txt", str(script), env=job_env)
    out = (tmp_path / "out.txt").read_text()
    assert rc == 0, out
    first, second = next(ln.split()[1:] for ln in out.splitlines() if ln.startswith("NODES"))
    rows = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("RANK"))
    port = SLURM_MASTER_PORT_BASE + job % SLURM_MASTER_PORT_SPAN
    # Ranks 0-1 on the first node, 2-3 on the second; all agree on the first node as master.
    assert rows == [[str(r), "4", str(r % 2), (first, second)[r // 2], first, str(port), "slurm"]
                    for r in range(4)]


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


def test_gpu_job_without_gpus_fails_before_starting_anything(cluster, job_env, tiny_model,
                                                            tmp_path):
    conf = tiny_config(tmp_path / "c.yaml", tiny_model, tmp_path / "runs", "nogpu",
                       parallel={"backend": "auto"})
    _, rc = cluster.sbatch("--nodes=1", "--ntasks=2", str(SLURM / "colocated.sbatch"),
                           str(conf), env=job_env, cwd=tmp_path)
    out = job_output(tmp_path)
    assert rc != 0
    assert "the job holds no GPUs" in out and "--gpus-per-node=2" in out, out
    assert "trainer started" not in out


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
def test_colocated_script_trains_on_two_tasks_with_their_gpus(cluster, job_env, tiny_model,
                                                              tmp_path):
    conf = tiny_config(tmp_path / "c.yaml", tiny_model, tmp_path / "runs", "colo",
                       trainer={"steps": 2})
    _, rc = cluster.sbatch("--nodes=1", "--ntasks=2", "--gpus-per-node=2",
                           str(SLURM / "colocated.sbatch"), str(conf), env=job_env, cwd=tmp_path,
                           timeout=900)
    run = tmp_path / "runs" / "colo"
    out = job_output(tmp_path)
    assert rc == 0, out + read(run / "logs" / "trainer.log")[-3000:]
    assert "trainer: 2 tasks on node1 (GPUs per node: 2)" in out, out
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (.ci/setup-vllm.sh)")
def test_disaggregated_script_runs_the_vllm_quickstart(cluster, job_env, tmp_path):
    """examples/quickstart_vllm_cpu.yaml (the shipped model, KL-Cov, TP=2, a vLLM CPU server in
    bf16) as a disaggregated job on one node: `slurm serve` starts the server on one task, the
    trainer's two ranks roll out on it and sync the trained weights to it every step. Its
    log-probs stay within 1e-2 of the actor's fp32 recompute, the weight check passes, and the
    server is stopped with the job. (The shipped example as it is, but for where the venv is,
    the job's server instead of one rank 0 launches, TP=2 and a shorter run.)"""
    port = 31700
    cfg = yaml.safe_load((REPO / "examples" / "quickstart_vllm_cpu.yaml").read_text())
    cfg["model"]["hf_path"] = str(REPO / cfg["model"]["hf_path"])
    cfg["parallel"]["backend"] = "gloo"  # CPU jobs say so (no GPU under Slurm)
    cfg["parallel"]["tensor"] = 2  # the job's two trainer tasks: the vocab-parallel sync path
    cfg["rollout"]["max_new_tokens"] = 40
    cfg["rollout"]["server"].update(
        launch=0, urls_file=str(tmp_path / "runs" / "dis" / "server_urls.txt"),
        server_python=str(VLLM_PYTHON), base_port=port, startup_timeout_s=400,
        request_timeout_s=120)
    cfg["data"].update(prompts_per_step=8)
    cfg["data"]["arithmetic"]["num_train"] = 256
    cfg["trainer"].update(steps=2, val_interval=0, val_before_train=False, save_interval=0,
                          micro_batch_tokens=2048)
    cfg["logging"] = {"name": "dis", "runs_dir": str(tmp_path / "runs"), "progress_bar": False}
    cfg["cluster"] = {"gpus_per_node": 2}
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    _, rc = cluster.sbatch("--nodes=1", "--ntasks=3", str(SLURM / "disaggregated.sbatch"),
                           str(conf), env=job_env, cwd=tmp_path, timeout=900)
    run = tmp_path / "runs" / "dis"
    out = job_output(tmp_path)
    log = read(run / "logs" / "trainer.log")
    assert rc == 0, out + log[-3000:]
    # One node: the server listens on loopback and is published so.
    assert (run / "server_urls.txt").read_text() == f"http://127.0.0.1:{port}\n"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows)
    for r in rows:
        print(f"step {r['step']}: acc {r['acc/mean']:.2f}, drift {r['rollout/logprob_drift']:.2e}"
              f" (max {r['rollout/logprob_drift_max']:.2e}), sync {r['weight_sync/seconds']:.2f} s,"
              f" weight check {r['weight_check/seconds']:.2f} s of a {r['time/step']:.2f} s step "
              f"(probe drift {r['weight_check/drift_mean']:.2e})")
        assert 0 < r["acc/mean"] < 1  # the shipped model solves some problems, not all
        assert r["rollout/logprob_drift"] <= 1e-2 and r["weight_check/drift_mean"] <= 1e-2
        assert r["weight_sync/seconds"] > 0 and r["rollout/tokens_per_s"] > 0
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
