"""The real SGLang engine on a GPU machine: what tests/servers/test_sglang.py checks against the
fake server, against `python -m sglang.launch_server` (one CUDA device, TP=1).

    PYTHONPATH=.:tests/helpers python tests/gpu/run_sglang_engine.py [--server-python PY]  # 3-5 min

Needs SGLang 0.5.x importable by --server-python (default: this interpreter; the GPU box usually
has none, and then the script prints SKIP and exits 0) and torch with CUDA here.
1. Generation: 3 prompts x 4 samples at T=1 from a tiny random Qwen2 (bf16 serving): output ids
   agree with output_token_logprobs, log-probs within 1e-2 (mean) of an fp32 transformers
   reference; per-sample seeds reproduce with --enable-deterministic-inference.
2. Disk sync (/update_weights_from_disk) to another model: greedy tokens are its argmax and the
   log-probs follow it (<= 1e-2); weight_version checked on every answer.
3. NCCL sync (/init_weights_update_group + /update_weights_from_distributed, 1 MB buckets) back.
4. The server killed by its PID mid-rollout: restarted, every sample back once.
Prints one JSON line per check; exits 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from megatron_entropy.config import ServerConfig, WeightSyncConfig
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.server.sglang import SGLangEngine
from megatron_entropy.testing.toy_models import make_served_model
from serving_model import push_weights  # tests/helpers, on PYTHONPATH (tests/gpu/run_all.sh)

REPO = Path(__file__).resolve().parents[2]

PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 7, 3, 9, 12]]
FAILED: list[str] = []


def report(name: str, ok: bool, **values) -> None:
    print(json.dumps({"check": name, "ok": ok, **values}), flush=True)
    if not ok:
        FAILED.append(name)


def mean_drift(model, prompts, rows, temperature=1.0) -> float:
    diffs = []
    for prompt, row in zip(prompts, rows):
        for c in row:
            ids = torch.tensor([prompt + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            lp = torch.log_softmax(logits / temperature, -1)
            ref = lp.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
            diffs += (ref.cpu() - torch.tensor(c.logprobs)).abs().tolist()
    return sum(diffs) / len(diffs)


def greedy_is_argmax(model, rows) -> bool:
    for prompt, (c,) in zip(PROMPTS, rows):
        ids = torch.tensor([prompt + c.token_ids], device="cuda")
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
        chosen = lp.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
        if not bool((chosen >= lp.max(-1).values - 0.05).all()):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-python", default=sys.executable)
    args = ap.parse_args()
    probe = subprocess.run([args.server_python, "-c", "import sglang; print(sglang.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"SKIP: sglang is not importable by {args.server_python}")
        return
    if not torch.cuda.is_available():
        sys.exit("this check needs a CUDA device")
    import transformers

    print(f"sglang {probe.stdout.strip()}, torch {torch.__version__}", flush=True)
    torch.cuda.set_device(0)
    tmp = Path(tempfile.mkdtemp(prefix="sglang_gpu_"))
    dirs = {k: make_served_model(tmp / k, seed=s) for k, s in (("a", 0), ("b", 1))}
    models = {k: transformers.AutoModelForCausalLM.from_pretrained(
        d, local_files_only=True, dtype=torch.float32).cuda().eval() for k, d in dirs.items()}
    cfg = ServerConfig(launch=1, server_python=args.server_python, base_port=34000,
                       max_model_len=512, startup_timeout_s=900, health_timeout_s=60,
                       health_check_interval_s=2.0,
                       extra_args=["--mem-fraction-static", "0.3", "--disable-cuda-graph",
                                   "--enable-deterministic-inference"])
    engine = SGLangEngine(cfg, str(dirs["a"]), str(tmp / "run"))
    try:
        sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=3)
        out = engine.generate(PROMPTS, sampling)
        again = engine.generate(PROMPTS, sampling)
        d = mean_drift(models["a"], PROMPTS, out)
        report("generate", d <= 1e-2, drift=d,
               reproducible=[[c.token_ids for c in r] for r in out]
               == [[c.token_ids for c in r] for r in again],
               tokens_per_s=engine.metrics().get("rollout/tokens_per_s"))

        stats = push_weights(engine, models["b"].state_dict().items(), 1, tmp / "run")
        greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
        d = mean_drift(models["b"], PROMPTS, greedy)
        report("disk sync", d <= 1e-2 and greedy_is_argmax(models["b"], greedy), drift=d,
               seconds=stats["weight_sync/seconds"], bytes=stats["weight_sync/bytes"])

        engine.weight_sync = WeightSyncConfig(strategy="broadcast", backend="nccl",
                                              master_addr="127.0.0.1")
        stats = push_weights(engine, ((n, t.cuda()) for n, t in models["a"].state_dict().items()),
                             2, tmp / "run", bucket_mb=1)
        greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
        d = mean_drift(models["a"], PROMPTS, greedy)
        report("nccl sync", d <= 1e-2 and greedy_is_argmax(models["a"], greedy), drift=d,
               seconds=stats["weight_sync/seconds"], bytes=stats["weight_sync/bytes"])

        engine.weight_sync = WeightSyncConfig()
        push_weights(engine, models["a"].state_dict().items(), 3, tmp / "run")
        server = engine.pool.servers[0]
        pid = server.process.pid

        def kill_when_busy():
            while server.inflight == 0:
                time.sleep(0.05)
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
        threading.Thread(target=kill_when_busy, daemon=True).start()
        prompts = [[10 + i, 20 + i] for i in range(32)]
        out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=256))
        report("kill mid-rollout", [len(r) for r in out] == [4] * 32
               and server.restarts == 1, restarts=server.restarts,
               samples=sum(len(r) for r in out), metrics=engine.metrics())
    finally:
        engine.shutdown()
    if FAILED:
        sys.exit(f"failed: {FAILED}")


if __name__ == "__main__":
    main()
