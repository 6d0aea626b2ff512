"""Starting the strict fake SGLang server (fake_sglang_server.py beside this file) for the
server tests: its command line for a launching engine, a server config around it, one started by
hand, the transformers greedy reference its completions are held to, and talking to it by hand
(a POST, the request log)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.server.process import free_port
from megatron_entropy.runtime.launch_env import healthy

FAKE = str(Path(__file__).resolve().parent / "fake_sglang_server.py")


def fake_command(version: str = "0.5.23", delay: float = 0.0, log: str = "",
                 busy_health_delay: float = 0.0, warmup: float = 0.0, exit_after: str = "",
                 extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, FAKE, "--model-path", "{model}", "--host", "{host}", "--port",
           "{port}", "--weight-version", "{weight_version}", "--version", version,
           "--token-delay-s", str(delay), "--busy-health-delay-s", str(busy_health_delay),
           "--warmup-s", str(warmup)]
    return (cmd + (["--request-log", log] if log else [])
            + (["--exit-after", exit_after] if exit_after else []) + list(extra))


def make_cfg(**kw) -> ServerConfig:
    base = dict(launch=1, base_port=32100, startup_timeout_s=120, request_timeout_s=60,
                health_check_interval_s=0.5, health_timeout_s=3, max_retries=2,
                max_concurrency=4,
                launch_command=fake_command())
    base.update(kw)
    return ServerConfig(**base)


def start_fake(model: Path, base_port: int, **fake_args) -> tuple[subprocess.Popen, str]:
    """A fake SGLang server that we start ourselves (the engine connects to it, as to a server
    it did not launch), on the first free port from ``base_port``, once it serves: its process
    and URL."""
    port = free_port("127.0.0.1", base_port, set())
    cmd = [a.format(model=model, host="127.0.0.1", port=port, weight_version="v0")
           for a in fake_command(**fake_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    # A server we connect to already serves (the engine gives one that refuses connections
    # only health_timeout_s): wait for it, as `slurm wait-servers` does.
    deadline = time.monotonic() + 120
    while not healthy(url, 1.0):
        assert proc.poll() is None and time.monotonic() < deadline, "the fake did not start"
        time.sleep(0.1)
    return proc, url


def greedy_reference(model, prompt: list[int], n_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def post(url: str, body: dict) -> tuple[int, object]:
    """(HTTP status, body) of a POST: decoded JSON, or the text of a plain-text answer."""

    def decoded(raw: bytes) -> object:
        try:
            return json.loads(raw or b"null")
        except ValueError:
            return raw.decode()

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, decoded(r.read())
    except urllib.error.HTTPError as e:
        return e.code, decoded(e.read())


def requests_of(log: Path, path: str) -> list[dict]:
    """The bodies of the requests to ``path`` in a fake's --request-log."""
    if not log.is_file():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [r["body"] for r in rows if r["path"] == path]
