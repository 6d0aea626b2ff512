"""The entropy-performance law and plots of a run's metrics."""

from megatron_entropy.analysis.entropy_law import (EntropyLawFit, Extrapolation, fit_and_predict,
                                                   fit_entropy_law)
from megatron_entropy.analysis.plots import law_points, plot_run, read_metrics

__all__ = ["EntropyLawFit", "Extrapolation", "fit_and_predict", "fit_entropy_law", "law_points",
           "plot_run", "read_metrics"]
