"""What both object-store rows (reliability.object_store_faults, reliability.object_store_outage)
stand on: the bucket, a fixture of raw shards and a model version put straight into the store, the
repository root the child commands run from."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

BUCKET = "reliability"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _put_fixture(client, rng: random.Random, shards: int = 6, size: int = 200_000) -> dict[str, bytes]:
    """Raw JSONL shards and a small model version laid out as the registry writes it."""
    objects = {}
    for i in range(shards):
        lines, n = [], 0
        while n < size:
            line = json.dumps({"text": rng.randbytes(40).hex(), "label": f"c{i % 3}"}) + "\n"
            lines.append(line)
            n += len(line)
        objects[f"raw/part-{i:02d}.jsonl"] = "".join(lines).encode()
    objects["models/m/v1/model.safetensors"] = rng.randbytes(300_000)
    objects["models/m/v1/config.json"] = b'{"hidden_size": 8}'
    objects["models/m/v1/tokenizer.json"] = rng.randbytes(50_000)
    for key, data in objects.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
    return objects


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
