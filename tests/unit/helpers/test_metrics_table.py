"""helpers/metrics_table.py, which every test reading a run's metrics uses: docs/metrics.md's
table's shortened names expand as written, `<word>` is one path segment, an unlisted key is
reported, and a page without the table says so."""

import pytest
from metrics_table import METRICS_PAGE, documented_metrics, undocumented_metrics

TABLE = """# Metrics

intro, `not/a_metric_either`

| key | meaning |
| --- | --- |
| `a/b_mean`, `_max`, `c/<source>/d` | x |
| `w/drift_mean`, `/drift_max`, `r/kl_k1`, `kl_k3` | y |

after the table: `not/a_metric`
"""


def test_shortened_names_expand_and_unlisted_keys_are_reported(tmp_path):
    page = tmp_path / "metrics.md"
    page.write_text(TABLE)
    assert [p.pattern for p in documented_metrics(page)] == [
        "a/b_mean", "a/b_max", "c/[^/]+/d", "w/drift_mean", "w/drift_max", "r/kl_k1", "r/kl_k3"]
    keys = ["step", "a/b_max", "c/gsm8k/d", "r/kl_k3", "w/drift_max"]
    assert undocumented_metrics(keys, page) == []
    assert undocumented_metrics(keys + ["c/x/y/d", "a/b_min", "not/a_metric"], page) == [
        "a/b_min", "c/x/y/d", "not/a_metric"]


def test_a_page_without_the_table_is_an_error(tmp_path):
    page = tmp_path / "metrics.md"
    page.write_text("# Metrics\n\nno table here\n")
    with pytest.raises(ValueError, match="no table headed"):
        documented_metrics(page)


def test_the_metrics_page_table_parses():
    assert METRICS_PAGE.name == "metrics.md" and METRICS_PAGE.parent.name == "docs"
    assert len(documented_metrics()) > 60
