"""Made-With-ML projects, trained from the shared copy: held-out weighted F1 (slow: real training).

The reference to beat is Made-With-ML's fine-tuned SciBERT, weighted F1 0.905 on its holdout.
The issue's goal of 0.95 is not reached yet on our held-out split (0.92-0.94 with MiniLM in every
variant tried, see docs/BENCHMARKS.md); this test holds the line at beating the reference.
"""

import json

import pytest

from tests.conftest import ROOT, SHARED, run_cli

DATASET = SHARED / "data" / "madewithml" / "dataset.csv"


@pytest.mark.slow
@pytest.mark.skipif(not DATASET.exists(), reason=f"the shared Made-With-ML copy is absent ({DATASET})")
def test_madewithml_beats_the_reference_f1(tmp_path):
    res = run_cli(
        "pipeline", "--config", str(ROOT / "configs" / "madewithml.yaml"),
        "--set", f"data.source={DATASET}", "--set", f"storage.embedded.data_dir={tmp_path}/s3",
        "--set", f"output_dir={tmp_path}/runs", "--set", f"cache.dir={tmp_path}/cache",
        timeout=1500,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((tmp_path / "runs" / "madewithml" / "pipeline.json").read_text())
    assert summary["model"]["name"] == "madewithml"
    f1 = summary["evaluate"]["weighted"]["f1"]
    assert summary["evaluate"]["rows"] >= 100
    assert f1 > 0.905, f"weighted F1 {f1:.4f} on {summary['evaluate']['rows']} held-out rows"
