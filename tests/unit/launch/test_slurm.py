"""launch/slurm.py without a Slurm cluster: node splitting, the layout the sbatch scripts eval (and
the scripts themselves), URL files, waiting for servers, the server command."""

import http.server
import os
import re
import shlex
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from cli_modules import cli_modules

from megatron_entropy.cli import main as cli_main
from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.launch.slurm import (NotEnoughNodesError, _visible_gpus, all_healthy,
                                           job_gpus_on_node, job_layout, layout_shell,
                                           server_bind_address, server_command, split_nodes,
                                           step_gpus, wait_for_servers, write_url)
from megatron_entropy.runtime import ParallelLayoutError, expand_nodelist
from megatron_entropy.rollout.server.errors import ServerError
from megatron_entropy.rollout.server.vllm import CPU_SITE
from megatron_entropy.runtime.launch_env import UrlFileError, read_urls_file

REPO = Path(__file__).resolve().parents[3]
SERVED = ["rollout.engine=sglang", "rollout.server.urls_file=urls.txt"]


def cfg(*overrides):
    return load_config(overrides=list(overrides))


@pytest.fixture
def no_scontrol(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)  # parse node lists ourselves


def test_split_fake_multinode_list(no_scontrol):
    nodes = expand_nodelist("gpu[003-005,010],gpu-x[1-2]")
    servers, trainers = split_nodes(nodes, 2, 3)
    assert servers == ["gpu003", "gpu004"]
    assert trainers == ["gpu005", "gpu010", "gpu-x1", "gpu-x2"]


def test_layout_gives_first_nodes_to_servers_and_the_rest_to_the_trainer(no_scontrol):
    c = cfg(*SERVED, "cluster.server_nodes=2", "cluster.server_gpus=2", "parallel.tensor=4",
            "parallel.pipeline=2")
    lay = job_layout(c, expand_nodelist("n[01-05]"))
    assert lay.server_nodes == ["n01", "n02"] and lay.trainer_nodes == ["n03", "n04", "n05"]
    assert (lay.servers_per_node, lay.num_servers, lay.trainer_tasks) == (4, 8, 24)
    assert not lay.shared


def test_too_few_nodes_names_what_the_config_needs():
    c = cfg(*SERVED, "cluster.server_nodes=2", "parallel.tensor=8", "parallel.pipeline=2")
    with pytest.raises(NotEnoughNodesError) as e:
        job_layout(c, ["a", "b", "c"])
    msg = str(e.value)
    assert "has 3 nodes" in msg and "needs 4" in msg and "cluster.server_nodes" in msg
    assert "TP x PP = 8 x 2" in msg and "--nodes=4" in msg


def test_layout_mistakes_are_refused():
    with pytest.raises(ParallelLayoutError, match="inside a node"):
        job_layout(cfg("parallel.tensor=16"), ["a", "b"])
    with pytest.raises(ConfigError, match="no servers are started"):
        job_layout(cfg("cluster.server_nodes=1"), ["a", "b"])  # in-process engine
    with pytest.raises(ConfigError, match="exceeds cluster.gpus_per_node"):
        job_layout(cfg(*SERVED, "cluster.server_nodes=1", "cluster.server_gpus=4",
                       "cluster.servers_per_node=3"), ["a", "b"])
    with pytest.raises(ParallelLayoutError, match="not divisible"):
        job_layout(cfg("parallel.tensor=3", "cluster.gpus_per_node=4"), ["a"])


def test_servers_share_the_first_trainer_node_without_server_nodes():
    lay = job_layout(cfg(*SERVED, "cluster.gpus_per_node=2"), ["vm"])
    assert lay.shared and lay.server_nodes == ["vm"] and lay.trainer_nodes == ["vm"]
    assert (lay.num_servers, lay.trainer_tasks) == (1, 2)
    # In-process engine: no servers at all.
    lay = job_layout(cfg("cluster.gpus_per_node=2"), ["vm"])
    assert lay.num_servers == 0 and not lay.shared


def test_layout_shell_evaluates_in_bash(tmp_path, no_scontrol):
    c = cfg(*SERVED, "cluster.server_nodes=1", "cluster.server_gpus=4", f"logging.runs_dir="
            f"{tmp_path / 'my runs'}", "logging.name=x")
    script = layout_shell(c, expand_nodelist("n[1-3]"), job_gpus=8) + \
        'echo "$RUN_DIR|$SERVER_NODELIST|$SERVERS_PER_NODE|$TRAINER_NODELIST|$TRAINER_TASKS|' \
        '$TRAINER_STEP_GPUS|$SERVER_STEP_GPUS"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == f"{tmp_path / 'my runs' / 'x'}|n1|2|n2,n3|16|8|8"


def test_every_step_asks_for_gpus_when_the_job_holds_them(no_scontrol):
    c = cfg(*SERVED, "cluster.server_nodes=1", "cluster.server_gpus=2",
            "cluster.servers_per_node=3")
    lay = job_layout(c, ["a", "b"])
    assert step_gpus(c, lay, job_gpus=8) == (8, 6)  # trainer: one per task; servers: 3 x 2
    # A CPU job (no GPUs held): steps ask for none, and the config must say so.
    assert step_gpus(cfg(*SERVED, "parallel.backend=gloo"), lay, job_gpus=0) == (0, 0)
    with pytest.raises(ConfigError, match=r"holds no GPUs .* --gpus-per-node=8 .* "
                                          r"parallel\.backend=gloo"):
        step_gpus(c, lay, job_gpus=0)
    with pytest.raises(ConfigError, match="holds 4 GPU.* cluster.gpus_per_node=8"):
        step_gpus(c, lay, job_gpus=4)


def test_the_jobs_gpus_come_from_slurms_variables():
    assert job_gpus_on_node({"SLURM_JOB_GPUS": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4"}) == 4
    assert job_gpus_on_node({"SLURM_GPUS_ON_NODE": "2"}) == 2
    assert job_gpus_on_node({}) == 0


def test_layout_command_prints_error_and_fails(tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text("cluster: {server_nodes: 3}\nrollout: {engine: vllm, server: "
                    "{urls_file: u.txt}}\n")
    assert cli_main(["slurm", "layout", "--nodelist", "a,b", str(conf)]) == 1
    assert "the job has 2 nodes" in capsys.readouterr().err
    assert cli_main(["slurm", "layout", "--nodelist", "a,b,c,d", "--job-gpus", "2", str(conf),
                     "cluster.gpus_per_node=2"]) == 0
    values = dict(line.split("=", 1) for line in capsys.readouterr().out.split())
    assert values["SERVER_NODELIST"] == "a,b,c" and values["TRAINER_NODELIST"] == "d"
    assert shlex.split(values["URLS_FILE"]) == [str(Path("u.txt").resolve())]


def test_url_files_round_trip(tmp_path):
    write_url(tmp_path / "d", 1, "http://b:30001")
    write_url(tmp_path / "d", 0, "http://a:30000")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["0", "1"]  # no temp files left
    f = tmp_path / "urls.txt"
    f.write_text("# servers\nhttp://a:1\n\nhttp://b:2\n")
    assert read_urls_file(f) == ["http://a:1", "http://b:2"]
    f.write_text("a:1\n")
    with pytest.raises(UrlFileError, match="'a:1' is not an http"):
        read_urls_file(f)
    f.write_text("# none yet\n\n")
    with pytest.raises(UrlFileError, match="lists no URL"):
        read_urls_file(f)
    with pytest.raises(FileNotFoundError, match="urls_file .*missing.txt' does not exist"):
        read_urls_file(tmp_path / "missing.txt")


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wait_for_servers_needs_every_server_healthy(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        good = f"http://127.0.0.1:{httpd.server_address[1]}"
        urls_dir, out = tmp_path / "urls.d", tmp_path / "urls.txt"
        write_url(urls_dir, 0, good)
        with pytest.raises(TimeoutError, match="1 of 2 servers"):
            wait_for_servers(urls_dir, 2, out, timeout=0.5, poll_s=0.1)
        write_url(urls_dir, 1, "http://127.0.0.1:9")  # published, but nothing answers
        with pytest.raises(TimeoutError):
            wait_for_servers(urls_dir, 2, out, timeout=0.5, poll_s=0.1)
        assert not out.exists()
        with pytest.raises(RuntimeError, match="server step ended"):
            wait_for_servers(urls_dir, 2, out, timeout=30, alive=lambda: False, poll_s=0.1)
        write_url(urls_dir, 1, good)
        assert wait_for_servers(urls_dir, 2, out, timeout=5, poll_s=0.1) == [good, good]
        assert read_urls_file(out) == [good, good]
    finally:
        httpd.shutdown()


class _HealthOnlyTogether(http.server.BaseHTTPRequestHandler):
    """Answers /health only once ``barrier.parties`` probes wait at the same time."""

    barrier: threading.Barrier

    def do_GET(self):
        try:
            self.barrier.wait()
            self.send_response(200)
        except threading.BrokenBarrierError:
            self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_servers_are_probed_all_at_once():
    """Three servers whose /health answers only while all three probes are in flight: probed
    one after the other (a dead node then costs one timeout per server), none would be
    healthy."""
    _HealthOnlyTogether.barrier = threading.Barrier(3, timeout=10)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HealthOnlyTogether)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert all_healthy([url] * 3, timeout=20)
        _HealthOnlyTogether.barrier = threading.Barrier(2, timeout=10)
        assert not all_healthy([url, url, "http://127.0.0.1:9"], timeout=20)  # one is down
        assert all_healthy([])
    finally:
        httpd.shutdown()


def test_servers_listen_on_loopback_unless_the_job_spans_nodes():
    c = cfg()
    assert server_bind_address(c, "node1", job_nodes=1) == ("127.0.0.1", "127.0.0.1")
    # Across nodes: the address the node's name resolves to, published by name ...
    assert server_bind_address(c, "10.20.30.40", job_nodes=2) == ("10.20.30.40", "10.20.30.40")
    # ... or, where it resolves to loopback here (127.0.1.1 on Debian-style hosts), every
    # interface, since the other nodes could not reach a loopback address.
    assert server_bind_address(c, "localhost", job_nodes=2) == ("0.0.0.0", "localhost")
    # parallel.socket_ifname names the interface whose address the other nodes reach.
    lo = cfg("parallel.socket_ifname=lo")
    assert server_bind_address(lo, "node1", job_nodes=4) == ("127.0.0.1", "127.0.0.1")
    with pytest.raises(ConfigError, match="parallel.socket_ifname='nosuchif0'"):
        server_bind_address(cfg("parallel.socket_ifname=nosuchif0"), "node1", job_nodes=4)


def test_server_gpus_slice_the_node(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [_visible_gpus(i, 2, 8) for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert _visible_gpus(1, 2, 8) == "6,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # Slurm bound the task already
    assert _visible_gpus(0, 1, 8) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match="needs GPUs"):
        _visible_gpus(2, 4, 8)


def test_server_command_is_the_engines_own_with_server_tp():
    c = cfg("rollout.engine=vllm", "rollout.server.urls_file=u", "model.hf_path=/m",
            "cluster.server_gpus=2", "rollout.server.extra_env=[A=1]")
    argv, env = server_command(c, "0.0.0.0", 30001)
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--model", "/m"), ("--host", "0.0.0.0"), ("--port", "30001"),
                        ("--logprobs-mode", "processed_logprobs"),
                        ("--tensor-parallel-size", "2")):
        assert argv[argv.index(flag) + 1] == value
    expected = {"A": "1", "VLLM_SERVER_DEV_MODE": "1"}
    if not torch.cuda.is_available():  # a CPU server asks for AMX permission (vllm.server_env)
        expected["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(CPU_SITE), os.environ.get("PYTHONPATH", "")) if p)
    assert env == expected
    argv, _ = server_command(cfg("rollout.engine=sglang", "rollout.server.urls_file=u",
                                 "model.hf_path=/m", "cluster.server_gpus=4"), "h", 1)
    assert argv[argv.index("--tp-size") + 1] == "4" and "--weight-version" in argv



@pytest.mark.parametrize("script", sorted((REPO / "slurm").glob("*.sbatch")) +
                         [REPO / "slurm" / "common.sh"], ids=lambda p: p.name)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    if script.suffix == ".sbatch":
        text = script.read_text()
        assert text.startswith("#!/bin/bash\n# ")  # documented at the top
        assert "#SBATCH" in text


def test_scripts_expand_arrays_safely_under_set_u():
    """`"${a[@]}"` of an empty array is an unbound-variable error under `set -u` before bash 4.4
    (login nodes of RHEL/CentOS 7 run 4.2; this machine's 5.2 cannot show it, so the source is
    checked): the scripts write `${a[@]+"${a[@]}"}`."""
    checked = 0
    for script in sorted((REPO / "slurm").iterdir()):
        text = script.read_text()
        for m in re.finditer(r'"\$\{(\w+)\[[@*]\]\}"', text):
            line = text.count("\n", 0, m.start()) + 1
            if text.splitlines()[line - 1].lstrip().startswith("#"):
                continue  # a comment that shows the idiom
            assert text[:m.start()].endswith("${" + m.group(1) + "[@]+"), \
                f"slurm/{script.name}:{line}: {m.group(0)} fails under set -u when empty"
            checked += 1
    assert checked >= 3  # the guarded expansions in common.sh were seen


def test_server_environment_is_parsed_as_the_engines_own_servers_parse_it():
    """One parser for rollout.server.extra_env (rollout/server/process.py's): the value keeps its
    '=', and an item without one is an error naming it (a Slurm server once dropped it
    silently)."""
    served = ("rollout.engine=vllm", "rollout.server.urls_file=u", "model.hf_path=/m")
    _, env = server_command(cfg(*served, "rollout.server.extra_env=[A=1=2]"), "h", 1)
    assert env["A"] == "1=2"
    with pytest.raises(ServerError, match="extra_env item 'NOVALUE' must look like KEY=VALUE"):
        server_command(cfg(*served, "rollout.server.extra_env=[NOVALUE]"), "h", 1)


@pytest.mark.parametrize("argv, flags", [
    (["slurm", "layout"], ["--nodelist", "--job-gpus", "config", "overrides"]),
    (["slurm", "serve"], ["--urls-dir", "config"]),
    (["slurm", "wait-servers"], ["--urls-dir", "--count", "--out", "--timeout", "--pid"]),
    (["convert", "hf-to-mcore"], ["--hf-dir", "--out", "--tp", "--pp", "--dtype", "--overwrite",
                                  "--quiet"]),
    (["convert", "mcore-to-hf"], ["--ckpt", "--out", "--hf-config-from", "--dtype",
                                  "--max-shard-size", "--overwrite", "--quiet"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v[0] in ("slurm", "convert") else "")
def test_the_cli_fronts_the_slurm_helpers_and_conversion(argv, flags, capsys):
    with pytest.raises(SystemExit) as done:
        cli_main([*argv, "--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    assert all(re.search(rf"(^|\s|\[){re.escape(f)}\b", listed) for f in flags), listed
    with pytest.raises(SystemExit) as done:
        cli_main(["--help"])
    assert done.value.code == 0 and argv[0] in capsys.readouterr().out


def _slurm_helper_modules(*args: str, code: int) -> set[str]:
    """Run as the sbatch scripts run it (python -m megatron_entropy.cli slurm ...)."""
    loaded, _ = cli_modules("slurm", *args, code=code)
    assert "megatron_entropy.launch.slurm" in loaded
    return loaded


def test_slurm_helpers_load_only_their_command(tmp_path):
    """The CLI loads the named command's module only: no analysis (numpy) or plan modules in a
    Slurm helper, and neither torch nor numpy: the layout loads and validates the config (whose
    settings modules, the study's and eval's sections included, are standard library only and
    in config/), waiting for the servers does not load it."""
    conf = tmp_path / "c.yaml"
    conf.write_text("parallel: {backend: gloo}\n")
    layout = _slurm_helper_modules("layout", "--nodelist", "n[1-2]", str(conf), code=0)
    wait = _slurm_helper_modules("wait-servers", "--urls-dir", str(tmp_path / "none"), "--count",
                                 "1", "--out", str(tmp_path / "urls"), "--timeout", "0", code=1)
    for loaded in (layout, wait):
        heavy = {m for m in loaded if m.startswith(("megatron_entropy.analysis.",
                                                     "megatron_entropy.launch.plan",
                                                     "megatron_entropy.launch.convert"))}
        assert not heavy, heavy
    assert not (layout | wait) & {"torch", "numpy"}
