"""A LoRA policy in the RL loop: the reference policy is the policy with its adapters off, its
checkpoints hold the adapters and their optimizer and reshard across TP / PP / EP, a resume
checks the base, and a killed run resumes bit for bit."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from harness import (STABLE, kill_after_first_step, metrics_rows, run_distributed,
                     tiny_run_config, train_cli, train_from_dict, with_sections)
from lora_checks import lora_model, random_adapters_worker
from resume_steps import resumed_optimizer
from tiny_models import random_samples, save_tiny_hf_model

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    hf_dir = save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("lora_run_qwen2"))
    (adapters,) = run_distributed(random_adapters_worker, 1, hf_dir)
    return hf_dir, adapters


def _reference_worker(hf_dir, adapters, separate: bool):
    """One recompute and update of a LoRA policy at TP=2 whose reference is itself with the
    adapters off, or (``separate``) a second model of the base weights."""
    from megatron_entropy.config import AlgorithmConfig, TrainerConfig
    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.sharding import full_state_dict
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.model_setup import build_optimizer

    chunks, arch = lora_model(hf_dir, tensor=2, adapters=adapters)
    ref = chunks[0]
    if separate:
        ref = build_gpt_model(arch, tensor=2, dtype="fp32", transformer_impl="local",
                              seq_length=64)
        load_hf_weights(ref, hf_dir, arch)
        ref.requires_grad_(False)
    trainer = TrainerConfig(lr=1e-2, steps=1, adam_eps=1.0, micro_batch_tokens=64)
    optimizer, scheduler = build_optimizer(chunks, trainer)
    actor = Actor(arch, chunks, optimizer, scheduler,
                  AlgorithmConfig(loss="ppo_clip", kl_coef=0.5, kl_type="k3"), trainer, 1.0,
                  ref_model=ref)
    samples = random_samples(0)
    actor.recompute(samples)
    metrics = actor.update(samples, step=1)
    adapters_after = {n: t for n, t in full_state_dict(chunks[0]).items() if "_lora." in n}
    return ([s.ref_logprobs for s in samples], [s.old_logprobs for s in samples], metrics,
            adapters_after)


def test_kl_with_adapters_off_equals_kl_to_a_separate_reference(dense):
    hf_dir, adapters = dense
    same = run_distributed(_reference_worker, 2, hf_dir, adapters, False)[0]
    separate = run_distributed(_reference_worker, 2, hf_dir, adapters, True)[0]
    for a, b in zip(same[0], separate[0]):
        assert torch.equal(a, b)  # the same base computation, bit for bit
    # The policy is not its reference (the adapters move it): the KL term is not trivially 0.
    assert max(float((p - r).abs().max()) for p, r in zip(same[1], same[0])) > 1e-2
    assert same[2]["kl_ref"] > 0
    assert same[2] == separate[2]
    for name, t in separate[3].items():
        assert torch.equal(same[3][name], t), name


def _resume_worker(hf_dir, run_dir: str, tensor: int, pipeline: int, expert: int, first: int,
                   last: int, save_at, dtype: str, distributed: bool):
    """Steps ``first``..``last`` of a LoRA policy's optimizer at TP x PP x EP, resuming from the
    latest checkpoint when ``first`` > 1 and saving after ``save_at``; each adapter's grads
    drawn from its global name and the step. Returns this rank's full adapters and base."""
    from megatron.core import parallel_state as ps

    from megatron_entropy.models.lora import is_adapter_param
    from megatron_entropy.models.sharding import (expert_offset, full_state_dict, layer_offset,
                                                  to_global_name, tp_shard)

    chunks, arch = lora_model(hf_dir, tensor, pipeline, expert, dtype=dtype,
                              distributed_optimizer=distributed)
    optimizer, manager = resumed_optimizer(chunks, run_dir, dtype, distributed, first)
    module = chunks[0].module
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    for step in range(first, last + 1):
        for name, p in module.named_parameters():
            if not is_adapter_param(name):
                continue
            gname = to_global_name(name, layer_offset(module), expert_offset(module))
            shape = list(p.shape)
            if getattr(p, "tensor_model_parallel", False):
                shape[p.partition_dim] *= tp_size
            g = torch.Generator().manual_seed(zlib.crc32(f"{gname}:{step}".encode()))
            p.main_grad.copy_(tp_shard(name, torch.randn(shape, generator=g), p, tp_rank,
                                       tp_size))
        optimizer.step()
        if step == save_at:
            manager.save(step, chunks, optimizer, {"step": step}, arch, str(hf_dir))
    return full_state_dict(chunks[0])


def _union(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        out.update(r)
    return out


@pytest.mark.parametrize("layouts,dtype,distributed", [
    ([(2, 1), (1, 2), (2, 1)], "fp32", False),
    ([(1, 1), (2, 1), (1, 1)], "bf16", True)], ids=["tp2-pp2-tp2", "dp2-tp2-dp2-bf16"])
def test_lora_checkpoints_reshard_adapters_and_their_optimizer(dense, tmp_path, layouts, dtype,
                                                                distributed):
    """Six updates of the adapters in one run against the same six in three runs that resume
    from each other's checkpoints at other layouts: the adapters after are the same bit for
    bit (their main weights, Adam's moments and step came back), and the base never moved.
    The checkpoints hold the adapters alone."""
    hf_dir, _ = dense
    (tp, pp), middle, last = layouts
    want = _union(run_distributed(_resume_worker, 2, hf_dir, str(tmp_path / "ref"), tp, pp, 1,
                                  1, 6, None, dtype, distributed))
    run = str(tmp_path / "run")
    run_distributed(_resume_worker, 2, hf_dir, run, tp, pp, 1, 1, 2, 2, dtype, distributed)
    run_distributed(_resume_worker, 2, hf_dir, run, *middle, 1, 3, 4, 4, dtype,
                    middle == (1, 1) and distributed)
    got = _union(run_distributed(_resume_worker, 2, hf_dir, run, *last, 1, 5, 6, None, dtype,
                                 distributed))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    _assert_adapters_only(Path(run) / "checkpoints")


def _assert_adapters_only(ckpts: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    latest = ckpts / (ckpts / "latest").read_text().strip()
    keys = FileSystemReader(str(latest)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if not k.startswith("optimizer")]
    assert model_keys and all("_lora." in k for k in model_keys), model_keys


def test_expert_adapters_reshard_across_ep(tmp_path):
    hf_dir = save_tiny_hf_model("qwen3_moe", tmp_path / "moe")
    want = _union(run_distributed(_resume_worker, 2, hf_dir, str(tmp_path / "ref"), 1, 1, 2, 1,
                                  6, None, "fp32", False))
    run = str(tmp_path / "run")
    run_distributed(_resume_worker, 2, hf_dir, run, 1, 1, 2, 1, 2, 2, "fp32", False)
    run_distributed(_resume_worker, 2, hf_dir, run, 1, 1, 1, 3, 4, 4, "fp32", False)
    got = _union(run_distributed(_resume_worker, 2, hf_dir, run, 1, 1, 2, 5, 6, None, "fp32",
                                 False))
    assert sum(".local_experts." in n and "_lora." in n for n in want) == 2 * 4 * 4
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _config(model_dir: Path, run_dir: Path, name: str, **extra) -> dict:
    """A step of a LoRA policy (rank 4, adapters on every target) with a KL to the reference
    (the policy with its adapters off)."""
    return with_sections(tiny_run_config(
        model_dir, run_dir, name, model={"lora": {"rank": 4, "alpha": 8}},
        algorithm={"kl_coef": 0.05}, trainer={"steps": 1, "lr": 1e-2}), **extra)


def test_resume_on_another_base_is_refused(tmp_path):
    """The checkpoint's adapters belong to the base they were trained on: a resume with other
    base weights (same architecture, same names and shapes) stops with one line naming
    model.hf_path, exit 2, and leaves the run as it was; a resume without adapters names
    model.lora.rank."""
    import yaml

    from serving_model import make_served_model

    base, other = make_served_model(tmp_path / "a", seed=0), make_served_model(tmp_path / "b", 1)
    cfg = _config(base, tmp_path, "run")
    run_distributed(train_from_dict, 1, cfg, timeout=300)
    run = tmp_path / "run"
    before = _files(run)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    for override, key in ((f"model.hf_path={other}", "model.hf_path"),
                          ("model.lora.rank=0", "model.lora.rank=4")):
        proc = train_cli(tmp_path / "c.yaml", override, "trainer.steps=2",
                         log=tmp_path / "refused.log")
        assert proc.wait(timeout=300) == 2
        errors = [line for line in (tmp_path / "refused.log").read_text().splitlines()
                  if "error" in line]
        assert len(errors) == 1 and key in errors[0], errors
    assert "tensor " in errors[0] or "model.lora.rank" in errors[0]
    assert _files(run) == before


def test_expert_adapters_refused_before_any_rank_starts(tmp_path):
    """A mixture-of-experts policy's expert adapters under tensor parallelism, or synced alone
    to vLLM or SGLang: one line naming the key, exit 2, from the model's files before any rank starts or
    any server is asked (none listens here), and no run folder left."""
    import yaml

    from megatron_entropy.testing.toy_models import save_tokenizer

    model = save_tiny_hf_model("qwen3_moe", tmp_path / "moe")
    save_tokenizer(model)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_config(model, tmp_path / "runs", "run")))
    synced_alone = ["rollout.server.urls=[http://127.0.0.1:9]",
                    "rollout.weight_sync.strategy=adapters"]
    for overrides, key in ((["parallel.tensor=2"], "model.lora.targets"),
                           (["rollout.engine=vllm", *synced_alone],
                            "rollout.weight_sync.strategy=adapters: a mixture-of-experts"),
                           (["rollout.engine=sglang", *synced_alone],
                            "rollout.weight_sync.strategy=adapters: a mixture-of-experts")):
        proc = train_cli(tmp_path / "c.yaml", *overrides, log=tmp_path / "refused.log")
        assert proc.wait(timeout=300) == 2
        log = (tmp_path / "refused.log").read_text()
        errors = [line for line in log.splitlines() if "error" in line]
        assert len(errors) == 1 and key in errors[0] and "rank" not in log, log
    assert not (tmp_path / "runs" / "run").exists()


def _files(run: Path) -> dict[str, bytes]:
    """The run folder's files and their contents (the CLI's train.lock aside: a lock file)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != "train.lock"}


@pytest.mark.slow
def test_killed_lora_run_resumes_bit_identical(tmp_path):
    """A DP=2 LoRA run with a KL to its adapters-off reference, killed (SIGKILL) after its
    first checkpoint, resumes from its adapter-only checkpoint and reproduces an uninterrupted
    run's second step exactly (its update starts from the restored Adam moments); every
    checkpoint holds the adapters alone."""
    import yaml

    # The quickstart's policy solves some problems: advantages, so gradients, from the start.
    cfg = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    model = REPO / cfg["model"]["hf_path"]
    steps = 2
    cfg = _config(model, tmp_path, "ref", model={"dtype": "fp32", "seq_length": 512},
                  rollout={"n_samples": 8, "max_new_tokens": 40, "max_prompt_tokens": 128},
                  data={"prompts_per_step": 8, "apply_chat_template": True},
                  trainer={"steps": steps, "keep_last": steps, "micro_batch_tokens": 2048})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    threads = {"OMP_NUM_THREADS": "1"}
    victim = train_cli(tmp_path / "c.yaml", "logging.name=victim", "--nproc", "2",
                       log=tmp_path / "victim.log", **threads)
    metrics = tmp_path / "victim" / "metrics.jsonl"
    kill_after_first_step(victim, metrics, tmp_path / "victim.log",
                          lambda: run_distributed(train_from_dict, 2, cfg, timeout=300))
    killed_at = len(metrics.read_text().splitlines())
    resumed = train_cli(tmp_path / "c.yaml", "logging.name=victim", "--nproc", "2",
                        log=tmp_path / "resumed.log", **threads)
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "resumed.log").read_text()
    got, want = metrics_rows(tmp_path / "victim"), metrics_rows(tmp_path / "ref")
    assert killed_at < steps and [r["step"] for r in got] == list(range(1, steps + 1))
    assert want[1]["grad_norm"] > 0 and want[1]["loss/kl_ref"] > 0
    for g, w in zip(got, want):
        g = {k: v for k, v in g.items() if not k.startswith(STABLE)}
        w = {k: v for k, v in w.items() if not k.startswith(STABLE)}
        assert g == w, f"step {g['step']} differs"
    _assert_adapters_only(tmp_path / "victim" / "checkpoints")
    saved = json.loads((tmp_path / "victim" / "checkpoints" / "step_00000002" /
                        "trainer_state.json").read_text())
    assert saved["lora"]["rank"] == 4 and saved["lora"]["base"] == str(model.resolve())
