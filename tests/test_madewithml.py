"""The Made-With-ML reference: weighted F1 >= 0.95 on its own held-out split (slow: real training)."""

import json

import pytest

from tests.conftest import ROOT, SHARED, run_cli

DATASET = SHARED / "data" / "madewithml" / "dataset.csv"


@pytest.mark.slow
@pytest.mark.skipif(not DATASET.exists(), reason=f"the shared Made-With-ML copy is absent ({DATASET})")
def test_madewithml_reaches_095_weighted_f1(tmp_path):
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
    assert f1 >= 0.95, f"weighted F1 {f1:.4f} on {summary['evaluate']['rows']} held-out rows"
