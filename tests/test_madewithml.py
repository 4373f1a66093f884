"""Made-With-ML projects, trained from the shared copy: held-out weighted F1 (slow: real training).

The reference to beat is Made-With-ML's fine-tuned SciBERT, weighted F1 0.905 on its holdout, and
the goal is 0.95; `python -m benchmarks.madewithml` measures both (docs/BENCHMARKS.md: 0.932 on our
132-row held-out split, where one row is 0.0076 of F1). This test trains the shipped config with
2 of its 4 epochs (held-out F1 0.930 at 2 epochs, 0.932 at 3, measured on 2 CPUs; half the suite
time of 4) and is the floor under that figure: it fails when training, evaluation or the CSV path
regress, not on run-to-run noise of a few rows.
"""

import json

import pytest

from tests.conftest import ROOT, SHARED, run_cli

DATASET = SHARED / "data" / "madewithml" / "dataset.csv"


@pytest.mark.extended  # an accuracy benchmark: minutes of MiniLM training against a reference F1
@pytest.mark.skipif(not DATASET.exists(), reason=f"the shared Made-With-ML copy is absent ({DATASET})")
def test_madewithml_trains_to_a_strong_f1(tmp_path):
    res = run_cli(
        "pipeline", "--config", str(ROOT / "configs" / "madewithml.yaml"),
        "--set", f"data.source={DATASET}", "--set", f"storage.embedded.data_dir={tmp_path}/s3",
        "--set", f"output_dir={tmp_path}/runs", "--set", f"cache.dir={tmp_path}/cache", "--set", "train.epochs=2",
        timeout=1500,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((tmp_path / "runs" / "madewithml" / "pipeline.json").read_text())
    assert summary["model"]["name"] == "madewithml"
    f1 = summary["evaluate"]["weighted"]["f1"]
    assert summary["evaluate"]["rows"] >= 100
    assert f1 > 3 * summary["evaluate"]["baseline"]["f1"]
    assert f1 >= 0.88, f"weighted F1 {f1:.4f} on {summary['evaluate']['rows']} held-out rows"
