"""Prompt datasets, the synthetic tasks (arithmetic; sums and hinted, the study tasks), the resumable sampler
and dynamic sampling."""

from megatron_entropy.data.arithmetic import (ArithmeticProblem, generate_problems,
                                              train_val_problems)
from megatron_entropy.data.dataset import (DEFAULT_PROMPT_SUFFIX, DatasetError, PromptDataset,
                                           PromptItem, PromptRow, arithmetic_rows, data_notes,
                                           hinted_rows,
                                           load_prompt_dataset, load_tokenizer, read_rows,
                                           render_prompt, sums_rows)
from megatron_entropy.data.hinted import (HintedProblem, hinted_splits, mode_accuracy,
                                          solution_mode)
from megatron_entropy.data.dynamic_sampling import GroupFilter, has_reward_variance
from megatron_entropy.data.sampler import PromptSampler
from megatron_entropy.data.sums import (SumProblem, generate_sum_problems, train_val_sum_problems,
                                        worked_solution)

__all__ = ["ArithmeticProblem", "HintedProblem", "hinted_rows", "hinted_splits",
           "mode_accuracy", "solution_mode", "DEFAULT_PROMPT_SUFFIX", "DatasetError", "GroupFilter",
           "PromptDataset", "PromptItem", "PromptRow", "PromptSampler", "arithmetic_rows",
           "data_notes", "generate_problems", "has_reward_variance", "load_prompt_dataset", "load_tokenizer",
           "read_rows", "render_prompt", "SumProblem", "generate_sum_problems", "sums_rows",
           "train_val_problems", "train_val_sum_problems", "worked_solution"]
