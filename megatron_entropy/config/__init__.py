"""One typed config tree for a run, loaded from YAML with dotted command-line overrides.

- schema.py: the sections (each a ``Settings`` dataclass, megatron_entropy/settings.py) and the
  root ``Config``;
- loading.py: YAML + overrides -> ``Config`` (``load_config``, ``parse_overrides``);
- validation.py: the rules across sections;
- study.py, evaluation.py: the sections of ``megatron-entropy study`` and ``eval`` (the
  commands' own settings, kept here so that the tree is composed below every package that reads
  it).

Torch-free: the Slurm helpers and ``plan`` load configs without it.
"""

from megatron_entropy.config.evaluation import EvalConfig
from megatron_entropy.config.loading import load_config, parse_overrides
from megatron_entropy.config.schema import (AlgorithmConfig, AnalysisConfig, ArithmeticConfig,
                                            ChainLengthMode, ChainsConfig, ClusterConfig,
                                            Config, DataConfig,
                                            EntropyControlConfig, HintedConfig, LoggingConfig,
                                            ModelConfig,
                                            ParallelConfig, RewardConfig, RolloutConfig,
                                            ServerConfig, SumsConfig, TrainerConfig,
                                            WeightCheckConfig, WeightSyncConfig)
from megatron_entropy.config.study import (EntropyBonusSweep, StudyConfig, StudyLoss,
                                           ThresholdSweep)
from megatron_entropy.config.validation import validate
from megatron_entropy.settings import ConfigError

__all__ = ["AlgorithmConfig", "AnalysisConfig", "ArithmeticConfig", "ChainLengthMode",
           "ChainsConfig", "ClusterConfig", "Config",
           "ConfigError", "DataConfig", "EntropyBonusSweep", "EntropyControlConfig", "EvalConfig",
           "HintedConfig",
           "LoggingConfig", "ModelConfig", "ParallelConfig", "RewardConfig", "RolloutConfig",
           "ServerConfig", "StudyConfig", "StudyLoss", "SumsConfig", "ThresholdSweep",
           "TrainerConfig", "WeightCheckConfig", "WeightSyncConfig", "load_config",
           "parse_overrides", "validate"]
