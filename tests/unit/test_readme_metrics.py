"""helpers/readme_metrics.py, which every test reading a run's metrics uses: the README table's
shortened names expand as written, `<word>` is one path segment, and an unlisted key is
reported."""

from readme_metrics import documented_metrics, undocumented_metrics

TABLE = """intro

**Reading the metrics** (`metrics.jsonl`):

| key | meaning |
| --- | --- |
| `a/b_mean`, `_max`, `c/<source>/d` | x |
| `w/drift_mean`, `/drift_max`, `r/kl_k1`, `kl_k3` | y |

after the table: `not/a_metric`
"""


def test_shortened_names_expand_and_unlisted_keys_are_reported(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(TABLE)
    assert [p.pattern for p in documented_metrics(readme)] == [
        "a/b_mean", "a/b_max", "c/[^/]+/d", "w/drift_mean", "w/drift_max", "r/kl_k1", "r/kl_k3"]
    keys = ["step", "a/b_max", "c/gsm8k/d", "r/kl_k3", "w/drift_max"]
    assert undocumented_metrics(keys, readme) == []
    assert undocumented_metrics(keys + ["c/x/y/d", "a/b_min", "not/a_metric"], readme) == [
        "a/b_min", "c/x/y/d", "not/a_metric"]


def test_the_readme_table_parses():
    assert len(documented_metrics()) > 60
