"""The entropy-performance law, the exact per-step entropy change, plots of a run's metrics and
the study that reproduces the paper's figures at toy scale."""

from megatron_entropy.analysis.entropy_law import (CeilingInterval, EntropyLawFit, Extrapolation,
                                                   ceiling_interval, fit_and_predict,
                                                   fit_entropy_law, law_warning)
from megatron_entropy.analysis.plots import law_points, plot_run, read_metrics

__all__ = ["CeilingInterval", "EntropyLawFit", "Extrapolation", "ceiling_interval",
           "fit_and_predict", "fit_entropy_law", "law_points", "law_warning", "plot_run",
           "read_metrics"]
