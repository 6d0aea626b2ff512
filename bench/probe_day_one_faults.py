"""The faults a new user meets on day one, run on a fresh clone as that user would, each with the
quickstart (``examples/quickstart.yaml``: two ranks, TP=2): a rank killed or a Ctrl-C during
start-up, Ctrl-C and SIGTERM mid-run, two trainers on one run folder, a full and a read-only
runs_dir, bad model folders, bad input and rewards that fail or hang. For each it prints the last
line the user sees (or the line the fault is about), the exit code, the seconds it took and how
many processes of the run are left; then the table, for docs/fault_tolerance.md.

    python bench/probe_day_one_faults.py [--source .] [--clone /tmp/probe-clone]

Needs root for the small file systems (mount -t tmpfs); without it those rows say so. Takes
about ten minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import psutil

MARK = "PROBE_DAY_ONE_MARK"  # in every process of a probe: what is left of it is found by it
REWARDS = '''import time

def always_raise(response, ground_truth):
    raise ValueError("no reward today")

def always_hang(response, ground_truth):
    time.sleep(3600)
'''


class Probe:
    def __init__(self, clone: Path, work: Path) -> None:
        self.clone, self.work = clone, work
        self.rows: list[tuple[str, str, str, str, str]] = []

    # ---------------------------------------------------------------------------- running

    def start(self, name: str, args: list[str], overrides: tuple[str, ...] = (),
              config: Optional[Path] = None, folder: str = "") -> tuple[subprocess.Popen, Path]:
        """``megatron-entropy ARGS`` from the clone, as a terminal starts it (its own process
        group), output in a log; ``train`` gets the quickstart (or ``config``) and the run
        folder ``folder`` (default: ``name``) under the work folder."""
        log = self.work / f"{name}.log"
        cmd = [sys.executable, "-m", "megatron_entropy.cli", *args]
        if args[0] == "train":
            cmd += [str(config or self.clone / "examples" / "quickstart.yaml"),
                    f"logging.runs_dir={self.work / 'runs'}", f"logging.name={folder or name}",
                    "logging.progress_bar=false", *overrides]
        env = {**os.environ, "PYTHONPATH": str(self.clone), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", MARK: name}
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
            env.pop(key, None)
        proc = subprocess.Popen(cmd, cwd=self.clone, env=env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        proc.started = time.monotonic()  # type: ignore[attr-defined]
        return proc, log

    def finish(self, fault: str, proc: subprocess.Popen, log: Path, since: float,
               line: Optional[str] = None, timeout: float = 900) -> int:
        """Wait for ``proc``; record the row: ``line`` (a pattern: the first line it matches)
        or the last line, exit code, seconds since ``since``, processes left."""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        took = time.monotonic() - since
        time.sleep(1.0)  # what the kernel still delivers
        left = self.kill_left(Path(log).stem)
        lines = [x for x in re.split(r"[\r\n]+", log.read_text()) if x.strip()]
        shown = next((x for x in lines if line and re.search(line, x)),
                     lines[-1] if lines else "(nothing)")
        total = len(lines)
        self.rows.append((fault, str(proc.returncode), f"{took:.1f}", str(left),
                          f"`{shown.strip()}`" + (f" ({total} lines)" if total > 3 else "")))
        print(" | ".join(self.rows[-1]), flush=True)
        return proc.returncode

    def run(self, fault: str, name: str, args: list[str], *overrides: str,
            config: Optional[Path] = None, line: Optional[str] = None, folder: str = "") -> int:
        proc, log = self.start(name, args, overrides, config, folder)
        return self.finish(fault, proc, log, proc.started, line)  # type: ignore[attr-defined]

    @staticmethod
    def kill_left(name: str) -> int:
        left = 0
        for p in psutil.process_iter():
            try:
                if p.environ().get(MARK) == name and p.status() != psutil.STATUS_ZOMBIE:
                    left += 1
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return left

    @staticmethod
    def wait_for(proc: subprocess.Popen, ready: Callable[[], object], within_s: float = 300):
        deadline = time.monotonic() + within_s
        while not (found := ready()):
            if proc.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return found

    @staticmethod
    def ranks(proc: subprocess.Popen) -> list[psutil.Process]:
        try:
            children = psutil.Process(proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return sorted((c for c in children if "train" in " ".join(c.cmdline())),
                      key=lambda c: c.environ().get("RANK", ""))

    def metrics_steps(self, name: str) -> list[int]:
        path = self.work / "runs" / name / "metrics.jsonl"
        if not path.exists():
            return []
        steps = []
        for text in path.read_text().splitlines():
            try:
                steps.append(json.loads(text)["step"])
            except (ValueError, KeyError):
                pass
        return steps

    def note(self, text: str) -> None:
        fault, code, took, left, shown = self.rows[-1]
        self.rows[-1] = (fault, code, took, left, f"{shown}; {text}")
        print("   ", text, flush=True)

    # ---------------------------------------------------------------------------- faults

    def start_up_faults(self) -> None:
        proc, log = self.start("kill9", ["train"])
        ranks = self.wait_for(proc, lambda: r if len(r := self.ranks(proc)) == 2 else None)
        time.sleep(1.0)  # both import torch and Megatron
        if ranks:
            ranks[0].kill()
        self.finish("kill -9 of rank 0 at start-up", proc, log, time.monotonic())

        for name, nproc, moment in (("ctrlc_imports", 2, "imports"),
                                    ("ctrlc_model", 2, "model"),
                                    ("ctrlc_one", 1, "model")):
            proc, log = self.start(name, ["train"],
                                   ("parallel.tensor=1",) if nproc == 1 else ())
            if nproc == 2:
                self.wait_for(proc, lambda: len(self.ranks(proc)) == 2)
            if moment == "imports":
                time.sleep(1.0)
            else:
                self.wait_for(proc, lambda: "Loading weights" in log.read_text())
            os.killpg(proc.pid, signal.SIGINT)
            where = "while the ranks import" if moment == "imports" else "as the model loads"
            self.finish(f"Ctrl-C at start-up, {nproc} process{'es' * (nproc > 1)}, {where}",
                        proc, log, time.monotonic())

    def mid_run_faults(self) -> None:
        # Ctrl-C mid-run, then the same run resumed through its checkpoints folder.
        proc, log = self.start("ctrlc_run", ["train"])
        self.wait_for(proc, lambda: max(self.metrics_steps("ctrlc_run"), default=0) >= 1)
        os.killpg(proc.pid, signal.SIGINT)
        self.finish("Ctrl-C mid-run", proc, log, time.monotonic())
        latest = self.work / "runs" / "ctrlc_run" / "checkpoints" / "latest"
        saved = latest.read_text().strip() if latest.exists() else "none"
        steps = self.metrics_steps("ctrlc_run")
        self.note(f"checkpoint {saved}, metrics of steps {steps}")
        last = int(saved.split("_")[1]) if saved != "none" else 0
        self.run("trainer.resume=RUN/checkpoints", "ctrlc_resumed", ["train"],
                 f"trainer.resume={self.work / 'runs' / 'ctrlc_run' / 'checkpoints'}",
                 f"trainer.steps={last + 1}", folder="ctrlc_run")
        self.note(f"metrics of steps {self.metrics_steps('ctrlc_run')}")

        # A second trainer on a running one's folder; then SIGTERM to the first, mid-run.
        first, first_log = self.start("shared", ["train"])
        self.wait_for(first, lambda: max(self.metrics_steps("shared"), default=0) >= 1)
        self.run("a second trainer on the same run folder", "shared_second", ["train"],
                 folder="shared")
        os.killpg(first.pid, signal.SIGTERM)
        self.finish("SIGTERM mid-run (the first trainer)", first, first_log, time.monotonic())

    def disk_faults(self) -> None:
        for name, options, fault in (("full", "size=6m", "runs_dir on a 6 MiB file system"),
                                     ("readonly", "size=1m,ro", "read-only runs_dir")):
            disk = self.work / f"disk_{name}"
            disk.mkdir()
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                                      str(disk)], capture_output=True).returncode == 0
            if not mounted:
                self.rows.append((fault, "-", "-", "-", "not run: mounting a tmpfs needs root"))
                continue
            try:
                proc, log = self.start(name, ["train"],
                                       (f"logging.runs_dir={disk}", "trainer.save_interval=1",
                                        "trainer.steps=2"))
                self.finish(fault, proc, log, proc.started)  # type: ignore[attr-defined]
                if name == "full":
                    run = disk / name
                    partial = [str(p.relative_to(run)) for p in run.rglob("*.tmp")]
                    steps = [json.loads(x)["step"] for x in
                             (run / "metrics.jsonl").read_text().splitlines()] \
                        if (run / "metrics.jsonl").exists() else []
                    self.note(f"partial files left: {partial or 'none'}; metrics of steps "
                              f"{steps}")
            finally:
                subprocess.run(["umount", "-l", str(disk)])

    def model_faults(self) -> None:
        model = self.clone / "examples" / "quickstart_model"
        bare = self.work / "no_tokenizer"
        shutil.copytree(model, bare)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (bare / name).unlink()
        self.run("model folder without tokenizer files", "no_tokenizer", ["train"],
                 f"model.hf_path={bare}")
        nan = self.work / "nan_weight"
        shutil.copytree(model, nan)
        subprocess.run([sys.executable, "-c", (
            "import sys, torch; from safetensors.torch import load_file, save_file\n"
            "w = load_file(sys.argv[1])\n"
            "k = next(n for n in sorted(w) if 'mlp' in n and w[n].dim() == 2)\n"
            "w[k][0, 0] = float('nan')\n"
            "save_file(w, sys.argv[1], metadata={'format': 'pt'})"),
            str(nan / "model.safetensors")], check=True)
        self.run("a NaN in one weight", "nan_weight", ["train"], f"model.hf_path={nan}")

    def small_faults(self) -> None:
        self.run("`--nproc 0`", "nproc0", ["train", "--nproc", "0"])
        duplicate = self.work / "duplicate.yaml"
        duplicate.write_text("trainer:\n  lr: 1.0e-5\n  steps: 3\n  lr: 2.0e-5\n")
        self.run("a key given twice in a YAML file", "duplicate", ["train"], config=duplicate)
        numbers = self.work / "numbers.jsonl"
        numbers.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": 17, "answer": "3"}\n')
        self.run("a prompt that is a number", "number_prompt", ["train"],
                 f"data.train_files=[{numbers}]")
        self.run("`plan --nodes 0`", "plan0", ["plan", str(self.clone / "examples" /
                                                          "quickstart.yaml"), "--nodes", "0"])
        train = self.work / "train.jsonl"
        train.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?",
                                             "answer": str(2 * a)}) + "\n" for a in range(64)))
        self.run("`trainer.val_interval` without validation prompts", "no_val", ["train"],
                 f"data.train_files=[{train}]", "trainer.steps=1", "trainer.val_interval=1",
                 "trainer.val_before_train=false", line=r"(?i)warning.*valid")
        rewards = self.work / "probe_rewards.py"
        rewards.write_text(REWARDS)
        self.run("a reward that always raises", "reward_raises", ["train"],
                 f"reward.function={rewards}:always_raise")
        self.run("a reward that always hangs (`reward.timeout_s=2`)", "reward_hangs", ["train"],
                 f"reward.function={rewards}:always_hang", "reward.timeout_s=2")

    def table(self) -> str:
        head = ["| fault | exit | seconds | left | the line the user sees |",
                "| --- | --- | --- | --- | --- |"]
        return "\n".join([*head, *("| " + " | ".join(r) + " |" for r in self.rows)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(Path(__file__).resolve().parents[1]),
                        help="the repository to clone (default: this one)")
    parser.add_argument("--clone", default="/tmp/probe-clone")
    parser.add_argument("--only", nargs="*", default=[], metavar="PART",
                        help="run only these parts: start_up, mid_run, disk, model, small")
    args = parser.parse_args()
    clone = Path(args.clone)
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", args.source, str(clone)], check=True)
    work = clone / "probe"
    work.mkdir()
    probe = Probe(clone, work)
    commit = subprocess.run(["git", "-C", str(clone), "log", "-1", "--format=%h"],
                            capture_output=True, text=True).stdout.strip()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    cpu = next((x.split(":", 1)[1].strip() for x in
                subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                if x.startswith("Model name")), "?")
    started = time.monotonic()
    for name in args.only or ["start_up", "mid_run", "disk", "model", "small"]:
        getattr(probe, f"{name}_faults")()
    print(f"\nProbe of {commit} on a fresh clone, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu}, "
          f"{os.cpu_count()} cores; load before: {load.split('load average:')[-1].strip()}; "
          f"after: {os.getloadavg()[0]:.2f}; {time.monotonic() - started:.0f} s in all\n")
    print(probe.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
