"""`workflows bench generate` (#50) on the tiny chat model with tiny settings: every row and key is in
the JSON and the doc section (the figures themselves are the lead's run, on SmolLM2, on a quiet machine)."""

from __future__ import annotations

import json

import pytest

from tests.chat_serve_task import build_tiny_chat
from tests.conftest import ROOT


@pytest.mark.integration  # a real HTTP server (the peer) on 127.0.0.1
def test_bench_generate_writes_every_row_and_key(tmp_path):
    from benchmarks.record import record

    model = tmp_path / "tiny"
    build_tiny_chat(model)
    overrides = [f"model.name_or_path={model}", f"cache.dir={tmp_path}/cache", "storage.embedded.enabled=false",
                 f"storage.root={tmp_path}/store", "requests=32", "max_tokens=3", "repeats=1", "threads=1"]
    doc = tmp_path / "BENCHMARKS.md"
    result = record("generate", str(ROOT / "configs" / "chat.yaml"), overrides, "python -m benchmarks.generate",
                    results_dir=tmp_path, doc=doc)
    stored = json.loads((tmp_path / "generate.json").read_text())
    assert stored == result
    assert [r["row"] for r in stored["rows"]] == ["peer", "static", "ours_c1", "ours_c8", "ours_c16", "ours_c32"]
    for row in stored["rows"]:
        assert row["tokens"] == 32 * 3, row  # every request produced max_tokens, EOS ignored
        for key in ("tokens_per_s", "ttft_s_p50", "ttft_s_p99", "itl_s_p50", "itl_s_p99"):
            assert row[key] > 0, (row["row"], key)
    for key in ("tokens_per_s_vs_one_at_a_time", "ttft_p50_vs_peer", "decode_vs_flop_limit"):
        assert stored[key] > 0 and key in stored["meets_goals"], key
    assert stored["flop_limit_tokens_per_s"] > 0
    text = doc.read_text()
    assert "## Generation: continuous batching against one request at a time" in text and "ours_c" not in text
