import subprocess
import sys

import pytest

from megatron_entropy.config import ConfigError, load_config, parse_overrides
from megatron_entropy.models.arch import UnsupportedModelError, arch_from_hf_config
from megatron_entropy.runtime import ParallelLayoutError, check_layout
from tiny_models import tiny_hf_config


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_typo_key_names_path_and_suggests(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "algorithm:\n  clip_cov_ration: 0.1\n"))
    assert "algorithm.clip_cov_ration" in str(e.value)
    assert "did you mean 'algorithm.clip_cov_ratio'" in str(e.value)


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.lr: expected a number, got 'fast'"):
        load_config(_yaml(tmp_path, "trainer:\n  lr: fast\n"))
    with pytest.raises(ConfigError, match=r"parallel\.tensor: expected an integer"):
        load_config(_yaml(tmp_path, "parallel:\n  tensor: 2.5\n"))


def test_out_of_range_and_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.top_p: 1\.5 is out of range; it must be <= 1"):
        load_config(overrides=["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss: 'klcov'.*did you mean 'kl_cov'"):
        load_config(overrides=["algorithm.loss=klcov"])
    with pytest.raises(ConfigError, match=r"clip_cov_lb"):
        load_config(overrides=["algorithm.clip_cov_lb=6"])


def test_impossible_parallel_layout_names_keys():
    with pytest.raises(ParallelLayoutError, match=r"parallel\.tensor x parallel\.pipeline = 3 x 1"):
        check_layout(world_size=4, tensor=3, pipeline=1)
    assert check_layout(world_size=8, tensor=2, pipeline=2) == 2
    arch = arch_from_hf_config(tiny_hf_config("qwen2"))  # 4 heads, 2 KV heads
    with pytest.raises(UnsupportedModelError, match=r"parallel\.tensor=4 does not divide.*2 query"):
        arch.check_parallel(4, 1)
    with pytest.raises(UnsupportedModelError, match=r"parallel\.pipeline=3 does not divide"):
        arch.check_parallel(1, 3)


def test_yaml_then_dotted_overrides(tmp_path):
    cfg = load_config(_yaml(tmp_path, "algorithm:\n  loss: clip_cov\ntrainer:\n  lr: 1e-6\n"),
                      overrides=["algorithm.loss=kl_cov", "trainer.lr=2e-6", "rollout.stop=[a, b]",
                                 "algorithm.dual_clip_c=3"])
    assert cfg.algorithm.loss == "kl_cov"
    assert cfg.trainer.lr == 2e-6
    assert cfg.rollout.stop == ["a", "b"]
    assert cfg.algorithm.dual_clip_c == 3.0
    assert parse_overrides(["a.b.c=1"]) == {"a": {"b": {"c": 1}}}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["trainer.lr"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_yaml(tmp_path, "a: [1,\n"))


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedModelError, match="supported: Qwen2ForCausalLM, Qwen3ForCausalLM"):
        arch_from_hf_config({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        arch_from_hf_config(tiny_hf_config("mistral", sliding_window=64))
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'yarn'"):
        arch_from_hf_config(tiny_hf_config("llama", rope_scaling={"rope_type": "yarn"}))


def test_family_flags():
    q2, q3, ll = (arch_from_hf_config(tiny_hf_config(f)) for f in ("qwen2", "qwen3", "llama"))
    assert q2.qkv_bias and not q2.qk_layernorm
    assert q3.qk_layernorm and not q3.qkv_bias and q3.head_dim == 32
    assert ll.rope_scaling_factor == 8.0 and not ll.qkv_bias
    assert q2.padded_vocab_size == 1024
    # transformers 5 writes rope_parameters instead of rope_theta
    new = tiny_hf_config("qwen2", rope_parameters={"rope_theta": 5.0, "rope_type": "default"})
    del new["rope_theta"]
    assert arch_from_hf_config(new).rope_theta == 5.0


def test_package_imports_in_fresh_interpreter():
    subprocess.run([sys.executable, "-c", "import megatron_entropy"], check=True)


def test_seq_length_must_hold_a_full_sequence():
    with pytest.raises(ConfigError, match=r"model\.seq_length \(1000\) is shorter than a full "
                                          r"sequence: rollout\.max_prompt_tokens \+ "
                                          r"rollout\.max_new_tokens = 600 \+ 500 = 1100"):
        load_config(overrides=["model.seq_length=1000", "rollout.max_prompt_tokens=600",
                               "rollout.max_new_tokens=500"])
    assert load_config(overrides=["model.seq_length=1100", "rollout.max_prompt_tokens=600",
                                  "rollout.max_new_tokens=500"]).model.seq_length == 1100


def test_vllm_cpu_example_is_the_quickstart_with_working_cpu_server_flags():
    """examples/quickstart_vllm_cpu.yaml, which examples/README.md names for vLLM on a CPU machine
    (and tests/servers/test_vllm.py runs against a real server): the quickstart but for
    the engine, and the launched server gets the flags and environment that work there."""
    from pathlib import Path

    from megatron_entropy.rollout.server.process import parse_extra_env
    from megatron_entropy.rollout.server.vllm import server_argv

    examples = Path(__file__).resolve().parents[3] / "examples"
    cfg = load_config(examples / "quickstart_vllm_cpu.yaml")
    quickstart = load_config(examples / "quickstart.yaml").to_dict()
    got = cfg.to_dict()
    assert got["rollout"].pop("engine") == "vllm" and quickstart["rollout"].pop("engine")
    server = got["rollout"].pop("server")
    quickstart["rollout"].pop("server")
    assert got["logging"].pop("name") == "quickstart_vllm_cpu"
    quickstart["logging"].pop("name")
    assert got == quickstart
    argv = server_argv(cfg.rollout.server, "MODEL", 30000)
    assert argv[:3] == [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--max-model-len") + 1] == "256"
    assert "--enforce-eager" in argv and argv[argv.index("--max-num-batched-tokens") + 1] == "8192"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"  # rollout.server.dtype bf16, as vLLM says
    assert parse_extra_env(server["extra_env"]) == {"VLLM_CPU_KVCACHE_SPACE": "1",
                                               "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                               "HF_HUB_OFFLINE": "1"}
    assert cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens <= 256


def test_sections_are_the_components_settings():
    """No mirrors: the loss, the token rules and the rollout correction get the config's own
    objects; a rule between fields lives in its class, so building the class directly and
    loading the key give the same error; the optimizer's defaults are the trainer section's."""
    from megatron_entropy.algorithms.settings import (PolicyLossSettings,
                                                      RolloutCorrectionSettings, TokenRuleSettings)
    from megatron_entropy.config import TrainerConfig
    from megatron_entropy.settings import SettingError

    a = load_config().algorithm
    assert isinstance(a, PolicyLossSettings) and type(a.token_rules) is TokenRuleSettings
    assert type(a.rollout_correction) is RolloutCorrectionSettings
    with pytest.raises(SettingError) as direct:
        PolicyLossSettings(clip_cov_lb=6.0)
    with pytest.raises(ConfigError) as loaded:
        load_config(overrides=["algorithm.clip_cov_lb=6"])
    assert str(loaded.value) == f"algorithm.{direct.value}" == (
        "algorithm.clip_cov_lb: 6.0 must be below clip_cov_ub (5.0)")
    with pytest.raises(ConfigError, match=r"^algorithm\.token_rules\.entropy_clip: combines "
                                          r"with ppo_clip only"):
        load_config(overrides=["algorithm.token_rules.entropy_clip=true"])
    t = TrainerConfig()
    assert (t.weight_decay, t.lr, t.grad_clip) == (0.1, 1e-6, 1.0)
    assert TrainerConfig(steps=3, ppo_epochs=2, mini_batches_per_step=4).total_updates == 24
    with pytest.raises(ConfigError, match=r"^trainer\.distributed_optimizer: 'sometimes' is not bool "
                                          r"or 'auto'"):
        load_config(overrides=["trainer.distributed_optimizer=sometimes"])
    assert load_config(overrides=["trainer.distributed_optimizer=true"]
                       ).trainer.distributed_optimizer is True


def test_dtype_one_spelling_long_names_are_aliases():
    """fp32 / bf16 / fp16 everywhere; the long names (run folders' config.yaml from before, HF's
    spelling) load as aliases, silently; anything else is one error naming the key and the
    accepted values. The torch and the servers' spellings come from the one table."""
    import torch

    from megatron_entropy.models.builder import DTYPES
    from megatron_entropy.runtime.dtypes import long_name, name_of_long

    cfg = load_config(overrides=["rollout.server.dtype=bfloat16", "model.dtype=float32",
                                 "rollout.dtype=float16"])
    assert (cfg.rollout.server.dtype, cfg.model.dtype, cfg.rollout.dtype) == ("bf16", "fp32",
                                                                              "fp16")
    assert load_config().rollout.server.dtype == "bf16"
    assert load_config(overrides=["rollout.server.dtype=auto"]).rollout.server.dtype == "auto"
    with pytest.raises(ConfigError, match=r"^rollout\.server\.dtype: 'bf32' is not allowed; "
                                          r"choose one of 'auto', 'fp32', 'bf16', 'fp16'"):
        load_config(overrides=["rollout.server.dtype=bf32"])
    with pytest.raises(ConfigError, match=r"^model\.dtype: 'auto' is not allowed"):
        load_config(overrides=["model.dtype=auto"])
    assert DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert [long_name(n) for n in ("fp32", "bf16", "fp16", "auto")] == [
        "float32", "bfloat16", "float16", "auto"]
    assert name_of_long("bfloat16") == "bf16" and name_of_long(None) is None


def test_derived_seeds_are_pinned():
    """Every derived seed's value, as the formulas gave before they moved to runtime/seeds.py
    (a changed formula changes every run), and the call sites that use them."""
    import torch

    from megatron_entropy.data.arithmetic import generate_problems, train_val_problems
    from megatron_entropy.data.sampler import PromptSampler
    from megatron_entropy.runtime import seeds

    assert seeds.rollout_step_seed(3, 5) == 3 + 7_919 * 6 == 47_517
    assert seeds.validation_seed(3, 5) == 47_518
    assert seeds.refill_round_seed(47_517, 2) == 1_473_029 and seeds.refill_round_seed(None, 1) == 1
    assert (seeds.sample_seed(5, 2, 3), seeds.sample_seed(0, 0, 0)) == (1_260_221_659, 655_369_107)
    assert seeds.turn_seed(47_517, 1) == 1_381_650_439_996_278_659 and seeds.turn_seed(None, 2) is None
    assert seeds.update_seed(42, 7, 1, 2) == 4_280_191_554_000
    assert seeds.micro_batch_draw_seed(4_280_191_554_000, 3) == 4_267_350_979_338_003
    assert seeds.epoch_order_seed(4, 2) == 4_000_014
    assert seeds.task_split_seeds(6) == (12, 13)
    sampler = PromptSampler(10, True, 4)
    assert sampler.next_indices(10) == torch.randperm(  # epoch 0 of data.seed 4
        10, generator=torch.Generator().manual_seed(4_000_012)).tolist()
    train, val = train_val_problems(5, 3, 1, 2, 20, seed=6)
    assert val == generate_problems(3, 1, 2, 20, seed=13)
    assert train == generate_problems(5, 1, 2, 20, seed=12, exclude=frozenset(p.question
                                                                               for p in val))


@pytest.mark.parametrize("setting,dp,expected", [
    ("auto", 1, False), ("auto", 2, True), (False, 2, False), (True, 1, True)])
def test_distributed_optimizer_auto_is_on_where_there_is_more_than_one_dp_rank(setting, dp,
                                                                              expected):
    cfg = load_config(data={"trainer": {"distributed_optimizer": setting}})
    assert cfg.trainer.uses_distributed_optimizer(dp) is expected


@pytest.mark.parametrize("setting,on_gpu,expected", [
    ("auto", False, False), ("auto", True, True), (False, True, False), (True, False, True)])
def test_overlap_communication_auto_is_on_where_collectives_run_on_gpus(setting, on_gpu, expected):
    cfg = load_config(data={"trainer": {"overlap_communication": setting}})
    assert cfg.trainer.uses_overlap(on_gpu) is expected


def test_a_key_given_twice_is_an_error_naming_it_and_its_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 1.0e-5\n  steps: 3\n  lr: 2.0e-5\nalgorithm: {loss: kl_cov}\n")
    with pytest.raises(ConfigError, match=r"c.yaml': key 'lr' appears twice in one mapping: "
                                          r"line 2 and line 4$"):
        load_config(path)
    path.write_text("trainer: {lr: 1.0e-5}\nalgorithm: {lr: 2.0e-5}\n")  # one per section
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm.lr'"):
        load_config(path)


def test_relative_paths_in_a_config_file_are_taken_from_its_folder_first(tmp_path, monkeypatch):
    """A config copied elsewhere with what it reads beside it works from any working directory:
    a relative input path that exists beside the file is taken from there; one that does not
    stays relative to the working directory (the examples', written from the checkout's top),
    as do outputs and command-line overrides."""
    from megatron_entropy.config.loading import INPUT_PATH_KEYS

    beside = tmp_path / "copied"
    (beside / "model").mkdir(parents=True)
    for name in ("train.jsonl", "score.py"):
        (beside / name).write_text("")
    work = tmp_path / "work"
    (work / "examples").mkdir(parents=True)
    (work / "examples" / "val.jsonl").write_text("")
    monkeypatch.chdir(work)
    config = _yaml(beside, "model:\n  hf_path: model\ndata:\n  train_files: [train.jsonl]\n"
                           "  val_files: [examples/val.jsonl]\nreward:\n  function: score.py:f\n"
                           "trainer:\n  resume: auto\nlogging:\n  runs_dir: runs\n")
    cfg = load_config(config)
    assert cfg.model.hf_path == str(beside / "model")
    assert (cfg.data.train_files, cfg.data.val_files) == ([str(beside / "train.jsonl")],
                                                          ["examples/val.jsonl"])
    assert cfg.reward.function == f"{beside / 'score.py'}:f"
    assert (cfg.trainer.resume, cfg.logging.runs_dir) == ("auto", "runs")
    assert load_config(config, ["model.hf_path=model"]).model.hf_path == "model"
    # The same from the config file's own folder, given relative to the working directory.
    monkeypatch.chdir(tmp_path)
    assert load_config("copied/c.yaml").model.hf_path == str(beside / "model")
    # Every key named is one of the config's.
    for key in INPUT_PATH_KEYS:
        load_config(overrides=[f"{key}={'[]' if key.endswith('files') else 'x'}"])


def test_a_relative_path_that_exists_nowhere_says_where_it_was_looked_for(tmp_path, monkeypatch):
    from megatron_entropy.data import read_rows
    from megatron_entropy.data.dataset import DatasetError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=r"dataset file 'nope.jsonl' does not exist \(a "
                                           r"relative path in a config file is taken from the "
                                           r"file's folder, else from the working directory, "
                                           f"{tmp_path}\\)"):
        read_rows("nope.jsonl")


def test_every_cpu_example_ships_its_model():
    """Each example whose policy lives under examples/ finds it there (weights, config and
    tokenizer), and the long-response one asks for packed rows and CP=2 on the chains task."""
    from pathlib import Path

    import yaml

    repo = Path(__file__).resolve().parents[3]
    shipped = {p.name: yaml.safe_load(p.read_text())["model"]["hf_path"]
               for p in (repo / "examples").glob("*.yaml")}
    local = {name: path for name, path in shipped.items() if path.startswith("examples/")}
    assert "long_reasoning.yaml" in local
    for name, path in local.items():
        for part in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (repo / path / part).is_file(), f"{name}: {path}/{part}"
    cfg = load_config(repo / "examples" / "long_reasoning.yaml")
    assert (cfg.data.task, cfg.parallel.context, cfg.trainer.micro_batch_layout) == \
        ("chains", 2, "packed")
