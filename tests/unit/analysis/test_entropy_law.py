"""Entropy-law fit, extrapolation, metrics reading, plots and the plot/fit commands."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_entropy.analysis.entropy_law import (ceiling_interval, fit_and_predict, fit_entropy_law,
                                                   law_warning)
from megatron_entropy.analysis.plots import law_points, plot_run, read_metrics
from megatron_entropy.cli import main


def test_fit_recovers_the_law_exactly():
    h = np.linspace(1.2, 0.05, 30)
    r = -0.3 * np.exp(h) + 0.9
    fit = fit_entropy_law(h, r)
    assert fit.a == pytest.approx(0.3, abs=1e-12) and fit.b == pytest.approx(0.9, abs=1e-12)
    assert fit.r2 == pytest.approx(1.0) and fit.n == 30
    assert fit.ceiling == pytest.approx(0.6)
    assert np.allclose(fit.predict([0.0, 1.0]), [0.6, -0.3 * math.e + 0.9])


def test_fit_matches_polyfit_on_noisy_data():
    rng = np.random.default_rng(0)
    h = rng.uniform(0.1, 1.5, 80)
    r = -0.2 * np.exp(h) + 0.7 + rng.normal(0, 0.02, 80)
    h[5], r[9] = np.nan, np.inf  # ignored
    fit = fit_entropy_law(h, r)
    keep = np.isfinite(h) & np.isfinite(r)
    slope, intercept = np.polyfit(np.exp(h[keep]), r[keep], 1)
    assert fit.a == pytest.approx(-slope) and fit.b == pytest.approx(intercept)
    pred = slope * np.exp(h[keep]) + intercept
    r2 = 1 - ((r[keep] - pred) ** 2).sum() / ((r[keep] - r[keep].mean()) ** 2).sum()
    assert fit.r2 == pytest.approx(r2) and 0.5 < fit.r2 < 1 and fit.n == 78


def test_fit_recovers_a_and_b_from_noisy_data_within_their_standard_errors():
    rng = np.random.default_rng(3)
    n, sigma = 200, 0.02
    h = rng.uniform(0.05, 1.5, n)
    r = -0.3 * np.exp(h) + 0.9 + rng.normal(0, sigma, n)
    fit = fit_entropy_law(h, r)
    # Ordinary least squares on x = exp(H): se(slope) = sigma / sqrt(Sxx),
    # se(intercept) = sigma * sqrt(1/n + mean(x)^2 / Sxx). 4 se: fails with p < 1e-4.
    x = np.exp(h)
    sxx = ((x - x.mean()) ** 2).sum()
    se_a = sigma / math.sqrt(sxx)
    se_b = sigma * math.sqrt(1 / n + x.mean() ** 2 / sxx)
    assert abs(fit.a - 0.3) < 4 * se_a and abs(fit.b - 0.9) < 4 * se_b
    assert se_a < 0.01 and se_b < 0.01  # so the check above pins a and b down
    assert fit.r2 > 0.9 and law_warning(fit, r) == ""
    flat = fit_entropy_law(h, np.full(n, 0.4))
    assert flat.r2 == 1.0 and "the law is undetermined" in law_warning(flat, np.full(n, 0.4))


def test_ceiling_interval_covers_the_truth_at_about_its_nominal_rate():
    """400 synthetic runs of 40 steps: the 95% percentile-bootstrap interval of b - a contains
    the true ceiling (0.6) in 88-99% of them (binomial sd at 95%: 1.1 points; the percentile
    bootstrap runs a few points under nominal at this n)."""
    rng = np.random.default_rng(0)
    covered, widths = 0, []
    for i in range(400):
        h = np.sort(rng.uniform(0.1, 1.5, 40))[::-1]
        r = -0.3 * np.exp(h) + 0.9 + rng.normal(0, 0.02, 40)
        ci = ceiling_interval(h, r, resamples=500, confidence=0.95, seed=i)
        covered += ci.low <= 0.6 <= ci.high
        widths.append(ci.high - ci.low)
    assert 0.88 <= covered / 400 <= 0.99, covered / 400
    assert 0 < np.median(widths) < 0.2


def test_ceiling_interval_is_reproducible_and_rejects_what_it_cannot_resample():
    h = np.linspace(1.0, 0.1, 12)
    r = -0.2 * np.exp(h) + 0.7 + np.where(np.arange(12) % 2, 0.01, -0.01)
    one, two = ceiling_interval(h, r, seed=7), ceiling_interval(h, r, seed=7)
    assert one == two and one.low < fit_entropy_law(h, r).ceiling < one.high
    assert ceiling_interval(h, r, seed=8) != one
    with pytest.raises(ValueError, match="at least 3"):
        ceiling_interval([0.1, 0.2], [0.3, 0.4])
    with pytest.raises(ValueError, match="confidence"):
        ceiling_interval(h, r, confidence=1.0)


def test_fit_on_first_steps_predicts_the_rest():
    h = np.linspace(1.0, 0.1, 20)
    r = -0.25 * np.exp(h) + 0.8
    r_noisy = r + np.where(np.arange(20) % 2 == 0, 0.01, -0.01)
    e = fit_and_predict(h, r_noisy, k=10)
    pred = e.fit.predict(h[10:])
    assert e.mae == pytest.approx(np.abs(pred - r_noisy[10:]).mean())
    assert e.max_abs_error == pytest.approx(np.abs(pred - r_noisy[10:]).max())
    assert e.final_error == pytest.approx(pred[-1] - r_noisy[-1])
    assert e.mae < 0.05  # the law extrapolates
    assert e.to_dict()["fit/ceiling"] == pytest.approx(e.fit.ceiling)
    with pytest.raises(ValueError, match=r"k must be in \[2, 19\]"):
        fit_and_predict(h, r, k=20)


def test_fit_rejects_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least 2"):
        fit_entropy_law([0.5, float("nan")], [0.1, 0.2])
    with pytest.raises(ValueError, match="all entropy values are equal"):
        fit_entropy_law([0.5, 0.5, 0.5], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="same length"):
        fit_entropy_law([0.5, 0.4], [0.1])


def _write_run(path, steps: int = 24, val_every: int = 4, extra=True):
    path.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(1, steps + 1):
        h = 1.2 * math.exp(-s / 10)
        rec = {"step": s, "reward/mean": -0.3 * math.exp(h) + 0.95, "entropy/token_mean": h * 0.9,
               "entropy/seq_mean": h}
        if extra:
            rec.update({"acc/mean": rec["reward/mean"], "acc/arithmetic_1op": 0.5,
                        "entropy/arithmetic_1op/seq_mean": h * 1.1, "cov/mean": 0.01 / s,
                        "cov/selected_mean": 0.2 / s, "loss/selected_frac": 2e-3,
                        "loss/clip_frac": 0.01, "loss/ppo_kl": 1e-4, "grad_norm": 0.5, "lr": 1e-6,
                        "response/length_mean": 20 + s, "rollout/logprob_drift": 1e-6,
                        "time/rollout": 1.0})
        if s % val_every == 0:
            rec["val/acc/mean"] = -0.3 * math.exp(h) + 0.93
            rec["val/acc/arithmetic_1op"] = 0.6
        lines.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_read_metrics_is_tolerant(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "reward/mean": 0.1}\n\n{"step": 2, "reward/mean": 0.2}\n'
        '{"step": 1, "reward/mean": 0.15}\n[1, 2]\n{"step": 3, "reward/m')  # resumed + torn line
    records = read_metrics(run)
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 0.15), (2, 0.2)]
    assert read_metrics(run / "metrics.jsonl") == records
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        read_metrics(tmp_path / "missing")


def test_law_points_prefer_validation_accuracy(tmp_path):
    records = read_metrics(_write_run(tmp_path / "run"))
    h, r, hk, rk = law_points(records)
    assert (hk, rk, len(h)) == ("entropy/seq_mean", "val/acc/mean", 6)
    h, r, hk, rk = law_points(records, performance_key="reward/mean",
                              entropy_key="entropy/token_mean")
    assert (hk, rk, len(h)) == ("entropy/token_mean", "reward/mean", 24)
    few = read_metrics(_write_run(tmp_path / "few", val_every=100))
    assert law_points(few)[3] == "acc/mean"  # no validation steps: training accuracy


def test_plot_run_writes_every_figure(tmp_path):
    run = _write_run(tmp_path / "run")
    written = plot_run(run)
    assert sorted(p.name for p in written) == ["covariance.png", "entropy.png",
                                               "entropy_law.png", "reward.png", "training.png"]
    from PIL import Image

    for p in written:
        assert p.parent == run / "plots"
        with Image.open(p) as im:
            assert im.format == "PNG" and im.size[0] > 300
            # Not a blank canvas: a plot draws in several colours.
            assert len(im.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 5


def test_plot_run_skips_what_is_missing(tmp_path):
    run = _write_run(tmp_path / "run", extra=False, val_every=1000)
    names = sorted(p.name for p in plot_run(run, tmp_path / "out"))
    assert names == ["entropy.png", "entropy_law.png", "reward.png"]
    only_reward = tmp_path / "r"
    only_reward.mkdir()
    (only_reward / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert [p.name for p in plot_run(only_reward)] == ["reward.png"]


def test_cli_fit_and_plot(tmp_path, capsys):
    run = _write_run(tmp_path / "run", val_every=1)
    assert main(["fit", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    records = read_metrics(run)
    ref = fit_entropy_law([r["entropy/seq_mean"] for r in records],
                          [r["val/acc/mean"] for r in records])
    assert out["a"] == pytest.approx(ref.a) and out["ceiling"] == pytest.approx(ref.ceiling)
    assert out["extrapolation"]["k"] == 12
    assert main(["fit", str(run), "--fit-points", "5"]) == 0
    captured = capsys.readouterr()
    assert "ceiling at entropy 0" in captured.out and "fit on the first 5 steps" in captured.out
    assert "bootstrap interval of the ceiling" in captured.out and captured.err == ""

    assert main(["plot", str(run), "--out", str(tmp_path / "pngs")]) == 0
    listed = capsys.readouterr().out.split()
    assert len(listed) == 5 and all((tmp_path / "pngs").joinpath(p.split("/")[-1]).is_file()
                                    for p in listed)

    # A run the law does not describe: a warning, and the interval still printed.
    noisy = tmp_path / "noisy"
    noisy.mkdir()
    rng = np.random.default_rng(1)
    (noisy / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "entropy/seq_mean": 1.0 - s / 40, "val/acc/mean": float(v)}) + "\n"
        for s, v in enumerate(rng.uniform(0, 1, 30), start=1)))
    assert main(["fit", str(noisy), "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and "does not describe this run" in captured.err
    assert "95% bootstrap interval of the ceiling" in captured.out
    assert main(["fit", str(noisy), "--seed", "3", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["fit", str(noisy), "--seed", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == first  # seeded: the same interval
    assert first["r2"] < 0.5 and "does not describe" in first["warning"]
    assert first["ceiling_interval"]["low"] < first["ceiling_interval"]["high"]

    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert main(["fit", str(tmp_path / "flat")]) == 2
    assert "need at least 2 (entropy, reward) points" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
