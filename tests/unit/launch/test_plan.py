"""``megatron-entropy plan``: the paper's recipes fit with their node counts, bad layouts are
refused, and the counts behind the estimate equal what transformers and Megatron allocate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from harness import init_megatron, run_distributed
from tiny_models import tiny_hf_config, write_config

from megatron_entropy.cli import main
from megatron_entropy.config import load_config
from megatron_entropy.models.arch import arch_from_hf_config
from megatron_entropy.launch.plan import (KNOWN_MODELS, kv_bytes_per_token, make_plan,
                                          stage_adapter_params, stage_params, total_params)

REPO = Path(__file__).resolve().parents[3]
# The paper's six recipes; the long-response one (qwen2.5-32b-kl_cov-32k.yaml) is tested apart.
RECIPES = sorted(p for p in (REPO / "examples").glob("qwen2.5-*.yaml")
                 if not p.stem.endswith("-32k"))
LONG_RECIPE = REPO / "examples" / "qwen2.5-32b-kl_cov-32k.yaml"


def run_plan(capsys, *args: str) -> tuple[int, str]:
    code = main(["plan", *args])
    return code, capsys.readouterr().out


def documented_nodes(recipe: Path) -> str:
    """The node count the recipe's header tells users to plan and submit with."""
    return re.search(r"megatron-entropy plan \S+ --nodes (\d+)", recipe.read_text()).group(1)


def test_all_recipes_are_there():
    """The paper's six, Qwen2.5-7B-Instruct with the code tool and Qwen2.5-32B with LoRA."""
    assert [p.name for p in RECIPES] == sorted(
        [f"qwen2.5-{size}-{loss}.yaml" for size in ("7b", "32b")
         for loss in ("grpo", "clip_cov", "kl_cov")]
        + ["qwen2.5-7b-instruct-tools-kl_cov.yaml", "qwen2.5-32b-kl_cov-lora.yaml"])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_fits_on_its_documented_nodes(recipe, capsys):
    code, out = run_plan(capsys, str(recipe), "--nodes", documented_nodes(recipe),
                         "--gpus-per-node", "8")
    assert code == 0, out
    cfg = yaml.safe_load(recipe.read_text())
    tp, pp = cfg["parallel"]["tensor"], cfg["parallel"]["pipeline"]
    trainer_gpus = (int(documented_nodes(recipe)) - cfg["cluster"]["server_nodes"]) * 8
    assert f"{trainer_gpus} GPUs = TP {tp} x PP {pp} x DP {trainer_gpus // (tp * pp)}" in out
    share = int(re.search(r"total .* GiB \((\d+)% of 80 GiB\)", out).group(1))
    assert 30 < share < 90, out
    assert "KV capacity per server" in out and out.rstrip().endswith("verdict: fits")


@pytest.mark.parametrize("recipe,args,message", [
    ("7b-kl_cov", ["--nodes", "2"], r"the job has 2 nodes .* needs 3: 2 for rollout servers"),
    ("7b-kl_cov", ["--nodes", "4", "parallel.tensor=2", "trainer.distributed_optimizer=false"],
     r"needs ~7\d\.\d GiB .* over 90%"),
    ("7b-grpo", ["--nodes", "4", "model.recompute_activations=false",
                 "trainer.micro_batch_tokens=36864"], r"needs ~\d+\.\d GiB"),
    ("7b-clip_cov", ["--nodes", "4", "parallel.tensor=8"], r"does not divide the model's 28 "
                                                           r"attention heads"),
    ("32b-kl_cov", ["--nodes", "8", "parallel.pipeline=1", "trainer.distributed_optimizer=false"],
     r"needs ~8\d\.\d GiB"),
    ("32b-grpo", ["--nodes", "8", "parallel.pipeline=3"], r"does not divide the model's 64 layers"),
    ("32b-clip_cov", ["--nodes", "8", "--gpus-per-node", "4"], r"tensor=8 exceeds "
                                                               r"cluster.gpus_per_node=4"),
    ("7b-kl_cov", ["--nodes", "4", "trainer.micro_batch_tokens=4096"], r"cannot hold one full "
                                                                        r"sequence of 10240"),
    ("32b-kl_cov", ["--nodes", "8", "cluster.server_gpus=1", "--gpu-memory-gb", "64"],
     r"a server of 1 GPU\(s\) has room for 0 KV tokens"),
])
def test_layouts_that_do_not_fit_are_refused(recipe, args, message, capsys):
    code, out = run_plan(capsys, str(REPO / "examples" / f"qwen2.5-{recipe}.yaml"), *args)
    assert code == 1
    assert re.search(r"refused: .*" + message, out), out


def test_the_long_response_recipe_fits_with_the_context_parallelism_it_needs(capsys):
    """32k-token responses of Qwen2.5-32B without activation recompute: CP 4 holds a quarter of
    each sequence's activations per GPU and fits; CP 2 and CP 1 are refused."""
    nodes = documented_nodes(LONG_RECIPE)
    code, out = run_plan(capsys, str(LONG_RECIPE), "--nodes", nodes)
    assert code == 0, out
    assert "64 GPUs = TP 8 x PP 2 x CP 4 x DP 1" in out
    assert "1/4 per CP rank" in out and "CP: the gathered keys and values" in out
    assert "Adam moments (fp32, 1/4 by the distributed optimizer)" in out  # over DP x CP
    for context in (1, 2):
        code, out = run_plan(capsys, str(LONG_RECIPE), "--nodes", nodes,
                             f"parallel.context={context}")
        assert code == 1 and re.search(r"refused: the trainer needs ~\d+\.\d GiB", out), out


def test_options_may_follow_overrides_and_bad_input_is_named(capsys, tmp_path):
    recipe = str(RECIPES[0])
    def bad(*args: str) -> str:  # one line on stderr, exit 2, as every command's bad input
        assert main(["plan", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("megatron-entropy plan: error: "), err
        return err[0]

    assert "unknown config key 'cluster.x'" in bad(recipe, "parallel.tensor=8", "--nodes", "8",
                                                   "cluster.x=1")
    assert "--nodes must be given and >= 1 (got None)" in bad(recipe)
    assert "--nodes must be given and >= 1 (got 0)" in bad(recipe, "--nodes", "0")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{hf_path: {tmp_path / 'nowhere'}}}\n")
    assert "has no config.json; pass --model-config" in bad(str(cfg), "--nodes", "1")


def test_plan_reads_the_models_config_json(capsys, tmp_path):
    model = write_config("qwen3", tmp_path / "m")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{hf_path: {model}, seq_length: 2048}}\n"
                   "rollout: {max_new_tokens: 512}\ncluster: {gpus_per_node: 2}\n")
    code, out = run_plan(capsys, str(cfg), "--nodes", "1", "rollout.dtype=bf16")
    assert code == 0, out
    assert f"[{model / 'config.json'}]" in out and "in-process engine weights (bf16)" in out


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("qwen2", True), ("qwen3", False),
                                         ("llama", True), ("mistral", False),
                                         ("qwen3_moe", False)])
def test_parameter_count_equals_transformers(family, tied):
    import transformers

    hf = tiny_hf_config(family, tie_word_embeddings=tied)
    config = transformers.AutoConfig.for_model(hf["model_type"], **{
        k: v for k, v in hf.items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert total_params(arch_from_hf_config(hf)) == sum(p.numel() for p in model.parameters())


def test_kv_cache_bytes_equal_transformers_cache():
    import transformers

    hf = tiny_hf_config("qwen3")
    config = transformers.AutoConfig.for_model(hf["model_type"], **{
        k: v for k, v in hf.items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    seq = 10
    with torch.no_grad():
        cache = model(torch.arange(seq)[None], use_cache=True).past_key_values
    cached = sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in cache.layers)
    assert cached == seq * kv_bytes_per_token(arch_from_hf_config(hf), 4)


def _allocated(arch, tensor, pipeline, expert=1):
    """Parameters and fp32 training state (weights, DDP grad buffers, Adam) on this rank, and
    the weight decays of the optimizer's parameter groups, built with the trainer section's
    defaults (a mixture of experts: the dense and the expert-parallel buffers and optimizers)."""
    init_megatron(tensor, pipeline, expert=expert)
    from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    chunks = build_trainable_model(arch, ModelConfig(dtype="fp32", seq_length=64),
                                   ParallelConfig(tensor=tensor, pipeline=pipeline,
                                                  expert=expert))
    optimizer, _ = build_optimizer(chunks, TrainerConfig(), dtype="fp32")
    model = chunks[0]
    for p in model.parameters():
        p.main_grad.normal_()
    optimizer.step()  # Adam's moments exist after the first step
    experts = {p for name, p in model.named_parameters() if ".local_experts." in name}

    def adam(params) -> int:
        return sum(t.numel() * t.element_size()
                   for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                   for p, state in opt.optimizer.state.items() if p in params
                   for t in state.values() if torch.is_tensor(t) and t.dim() > 0)

    def grads(buffers) -> int:
        return sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)

    expert_buffers = list(getattr(model, "expert_parallel_buffers", []))
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() * p.element_size() for p in model.parameters()),
            grads(list(model.buffers) + expert_buffers), adam(set(model.parameters())),
            sorted({g["weight_decay"] for g in optimizer.param_groups}),
            # The experts' part: weights, grad buffer (Megatron's expert-parallel buffers) and
            # Adam's moments.
            (sum(p.numel() * p.element_size() for p in experts), grads(expert_buffers),
             adam(experts)))


@pytest.mark.parametrize("family,tied,tensor,pipeline", [("qwen3", False, 2, 2),
                                                         ("llama", True, 2, 2),
                                                         ("qwen2", True, 2, 1)])
def test_fullest_gpu_state_equals_megatrons(family, tied, tensor, pipeline, tmp_path):
    hf = tiny_hf_config(family, tie_word_embeddings=tied)
    arch = arch_from_hf_config(hf)
    ranks = run_distributed(_allocated, tensor * pipeline, arch, tensor, pipeline, timeout=200)
    params, weights, grads, adam, decays, _ = max(ranks)
    # One default: trainer.weight_decay's 0.1 reaches the optimizer (the old OptimSettings mirror
    # had 0.0); biases and norms keep none, as Megatron decides.
    assert decays == [0.0, 0.1]
    assert params == stage_params(arch, tensor, pipeline)
    cfg_dir = write_config(family, tmp_path / "m", tie_word_embeddings=tied)
    cfg = load_config(overrides=[f"model.hf_path={cfg_dir}", "model.dtype=fp32",
                                 f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}",
                                 f"cluster.gpus_per_node={tensor * pipeline}"])
    items = dict(make_plan(cfg, arch, nodes=1).trainer)
    assert items["weights (fp32)"] == weights
    assert items["grad buffer (fp32)"] == grads
    assert items["Adam moments (fp32)"] == adam


def test_a_layout_with_few_server_gpus_for_its_trainer_is_called_rollout_bound(capsys):
    recipe = str(REPO / "examples" / "qwen2.5-7b-kl_cov.yaml")
    code, out = run_plan(capsys, recipe, "--nodes", "32")  # 2 server nodes for 30 trainer nodes
    assert code == 0
    assert re.search(r"warning: rollout-bound: 240 trainer GPUs wait on 16 rollout server GPUs "
                     r"\(15 to 1; .*raise cluster.server_nodes \(e.g. 16", out), out
    # The verdict carries it, with the node split that balances the two (planned: it fits).
    assert out.strip().splitlines()[-1] == (
        "verdict: fits, but rollout-bound: 240 trainer GPUs wait on 16 rollout server GPUs (15 "
        "to 1); cluster.server_nodes=16 balances them (16 server + 16 trainer nodes: 128 server "
        "and 128 trainer GPUs, TP 4 x PP 1 x DP 32)")
    balanced = run_plan(capsys, recipe, "--nodes", "32", "cluster.server_nodes=16")
    assert balanced[0] == 0 and balanced[1].strip().splitlines()[-1] == "verdict: fits"
    code, out = run_plan(capsys, recipe, "--nodes", documented_nodes(Path(recipe)))
    assert code == 0 and "rollout-bound" not in out


def test_the_recipe_table_of_examples_readme_is_what_plan_says(capsys):
    """examples/README.md's recipe table: nodes, servers, trainer layout and trainer GPU memory
    of each recipe, as `megatron-entropy plan` prints them at the recipe's documented nodes."""
    text = (REPO / "examples" / "README.md").read_text()
    rows = re.findall(r"^\| (7B|32B) (GRPO|Clip-Cov|KL-Cov) \| [^|]+ \| (\d+) \| (\d+) x TP(\d+) "
                      r"on (\d+) nodes \| ([^|]+) \| ([\d.]+) GiB \|$", text, re.M)
    assert len(rows) == 6, rows
    for size, loss, nodes, servers, server_tp, server_nodes, trainer, gib in rows:
        name = {"GRPO": "grpo", "Clip-Cov": "clip_cov", "KL-Cov": "kl_cov"}[loss]
        recipe = REPO / "examples" / f"qwen2.5-{size.lower()}-{name}.yaml"
        assert nodes == documented_nodes(recipe)
        code, out = run_plan(capsys, str(recipe), "--nodes", nodes)
        assert code == 0, out
        assert f"rollout servers: {servers} x {server_tp} GPU(s) on {server_nodes} node(s)" in out
        layout = re.search(r"= TP (\d+) x PP (\d+) x DP (\d+)", out).groups()
        assert trainer.strip() == " x ".join(f"{k}{v}" for k, v in zip(("TP", "PP", "DP"), layout)
                                             if k != "PP" or v != "1"), (trainer, layout)
        total = float(re.search(r"  total +([\d.]+) GiB", out).group(1))
        assert gib == f"{total:.1f}", (recipe.name, gib, total)


def test_moe_stage_state_at_ep2_pp2_equals_megatrons(tmp_path):
    """Each GPU holds its EP rank's experts of its stage's layers and the router: parameters,
    weights, both grad buffers and Adam's moments as Megatron allocates them."""
    arch = arch_from_hf_config(tiny_hf_config("qwen3_moe"))
    ranks = run_distributed(_allocated, 4, arch, 1, 2, 2, timeout=200)
    params, weights, grads, adam, _, expert_parts = max(ranks)
    assert params == stage_params(arch, 1, 2, 2) < stage_params(arch, 1, 2, 1)
    cfg_dir = write_config("qwen3_moe", tmp_path / "m")
    cfg = load_config(overrides=[f"model.hf_path={cfg_dir}", "model.dtype=fp32",
                                 "parallel.pipeline=2", "parallel.expert=2",
                                 "trainer.distributed_optimizer=false", "cluster.gpus_per_node=4"])
    plan = make_plan(cfg, arch, nodes=1)
    items = dict(plan.trainer)
    assert items["weights (fp32)"] == weights
    assert items["grad buffer (fp32)"] == grads
    assert items["Adam moments (fp32)"] == adam
    # The experts' part of each, as Megatron allocates it (the dense part is the rest).
    keys = ("weights (fp32)", "grad buffer (fp32)", "Adam moments (fp32)")
    assert tuple(plan.trainer_parts[k][1][1] for k in keys) == expert_parts
    assert all(0 < b < items[k] for k, b in zip(keys, expert_parts))


@pytest.mark.parametrize("overrides", [[], ["model.dtype=fp32", "parallel.expert=4"],
                                       ["trainer.distributed_optimizer=false"]],
                         ids=["recipe", "fp32-ep4", "plain-optimizer"])
def test_moe_plan_prints_dense_and_expert_parts_that_add_up(capsys, overrides):
    """Weights, grad buffer, main weights and Adam's moments each with a dense and an expert
    line below: in bytes they add up to the item exactly, as printed to within the rounding of
    three 0.01 GiB figures; a dense model prints no parts."""
    recipe = REPO / "examples" / "qwen3-30b-a3b-kl_cov.yaml"
    code, out = run_plan(capsys, str(recipe), "--nodes", documented_nodes(recipe), *overrides)
    assert code in (0, 1) and "trainer memory per GPU" in out, out  # over memory: printed too
    cfg = load_config(recipe, overrides)
    plan = make_plan(cfg, arch_from_hf_config(KNOWN_MODELS["qwen3-30b-a3b"]), 8)
    split = [name for name, _ in plan.trainer if name in plan.trainer_parts]
    want = 3 if cfg.model.dtype == "fp32" else 4  # fp32 keeps no separate main weights
    assert len(split) == want and split[0].startswith("weights") \
        and split[-1].startswith("Adam moments")
    for name, total in plan.trainer:
        parts = plan.trainer_parts.get(name, [])
        assert not parts or sum(b for _, b in parts) == total, name
    lines = out.splitlines()
    for name in split:
        i = next(j for j, line in enumerate(lines) if line.startswith(f"  {name} "))
        item, *parts = [float(re.search(r"([\d.]+) GiB$", line).group(1))
                        for line in lines[i:i + 3]]
        assert lines[i + 1].lstrip().startswith("dense") and \
            lines[i + 2].lstrip().startswith("experts")
        assert abs(sum(parts) - item) <= 0.015, (name, item, parts)
    code, out = run_plan(capsys, str(RECIPES[0]), "--nodes", documented_nodes(RECIPES[0]))
    assert code == 0 and "dense" not in out and "experts (" not in out


def test_qwen3_moe_recipe_fits_and_the_built_in_models_have_their_published_sizes(capsys):
    recipe = REPO / "examples" / "qwen3-30b-a3b-kl_cov.yaml"
    code, out = run_plan(capsys, str(recipe), "--nodes", documented_nodes(recipe))
    assert code == 0, out
    assert "32 GPUs = TP 1 x PP 1 x DP 32 (EP 8" in out and "MoE all-to-all" in out
    # Qwen's model cards: 30.5B total / 3.3B active, 235B / 22B.
    assert "30.53B params (3.35B active: 128 experts, top-8)" in out
    code, out = run_plan(capsys, str(recipe), "--nodes", "40",
                         "model.hf_path=models/Qwen3-235B-A22B", "parallel.pipeline=2",
                         "parallel.expert=64", "cluster.server_nodes=8", "cluster.server_gpus=8",
                         "trainer.micro_batch_tokens=10240")
    assert code == 0 and "235.09B params (22.19B active" in out, out
    code, out = run_plan(capsys, str(recipe), "--nodes", "8", "parallel.expert=3")
    assert code == 1 and "parallel.expert=3 does not divide the model's 128 experts" in out


def test_the_lora_recipe_needs_one_trainer_node_where_full_fine_tuning_needs_two(capsys):
    """The 32B KL-Cov recipe with rank-32 adapters fits its trainer on one node of 8 GPUs; the
    same recipe without adapters does not fit there in any TP x PP layout of one node, and
    needs two nodes."""
    lora = REPO / "examples" / "qwen2.5-32b-kl_cov-lora.yaml"
    full = str(REPO / "examples" / "qwen2.5-32b-kl_cov.yaml")
    assert documented_nodes(lora) == "5"
    code, out = run_plan(capsys, str(lora), "--nodes", "5")
    assert code == 0 and "trainer: 1 node(s), 8 GPUs = TP 4 x PP 1 x DP 2" in out, out
    assert "weights (bf16, frozen)" in out and "LoRA adapters (rank 32, bf16)" in out
    for tp, pp in ((8, 1), (4, 2), (2, 4)):
        code, out = run_plan(capsys, full, "--nodes", "5", f"parallel.tensor={tp}",
                             f"parallel.pipeline={pp}")
        assert code == 1 and "refused: the trainer needs" in out, out
    code, out = run_plan(capsys, full, "--nodes", "6", "parallel.tensor=8",
                         "parallel.pipeline=2")
    assert code == 0, out


def _lora_allocated(arch, tensor, pipeline, expert=1):
    """The adapters' parameters, grad buffers and Adam moments (bytes) on this rank of a LoRA
    policy (rank 4, every target) built as the trainer builds it."""
    init_megatron(tensor, pipeline, expert=expert)
    from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
    from megatron_entropy.models.lora_settings import LoraSettings
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    chunks = build_trainable_model(arch, ModelConfig(dtype="fp32", seq_length=64,
                                                     lora=LoraSettings(rank=4)),
                                   ParallelConfig(tensor=tensor, pipeline=pipeline,
                                                  expert=expert))
    optimizer, _ = build_optimizer(chunks, TrainerConfig(), dtype="fp32")
    model = chunks[0]
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.main_grad.normal_()
    optimizer.step()
    experts = sum(p.numel() for n, p in model.named_parameters()
                  if p.requires_grad and ".local_experts." in n)
    buffers = list(model.buffers) + list(getattr(model, "expert_parallel_buffers", []))
    return (sum(p.numel() for p in trained) - experts, experts,
            sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            sum(t.numel() * t.element_size()
                for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                for state in opt.optimizer.state.values() for t in state.values()
                if torch.is_tensor(t) and t.dim() > 0))


@pytest.mark.parametrize("family,tensor,pipeline,expert", [("qwen2", 2, 2, 1),
                                                           ("qwen3", 2, 1, 1),
                                                           ("qwen3_moe", 1, 1, 2)])
def test_lora_state_equals_megatrons(family, tensor, pipeline, expert, tmp_path):
    """What plan counts for a LoRA policy is what the trainer allocates on its fullest rank:
    the adapters (dense and experts'), their fp32 grad buffer and Adam's moments."""
    hf = tiny_hf_config(family)
    arch = arch_from_hf_config(hf)
    world = tensor * pipeline * expert
    dense, experts, grads, adam = max(run_distributed(_lora_allocated, world, arch, tensor,
                                                      pipeline, expert, timeout=200))
    cfg_dir = write_config(family, tmp_path / "m")
    cfg = load_config(overrides=[f"model.hf_path={cfg_dir}", "model.dtype=fp32",
                                 "model.lora.rank=4", f"parallel.tensor={tensor}",
                                 f"parallel.pipeline={pipeline}", f"parallel.expert={expert}",
                                 f"cluster.gpus_per_node={world}",
                                 "trainer.distributed_optimizer=false"])
    lora = cfg.model.lora
    assert stage_adapter_params(arch, lora, tensor, pipeline, expert) == (dense, experts)
    items = dict(make_plan(cfg, arch, nodes=1).trainer)
    assert items["LoRA adapters (rank 4, fp32)"] == (dense + experts) * 4
    assert items["grad buffer (fp32)"] == grads
    assert items["Adam moments (fp32)"] == adam
