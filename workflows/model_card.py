"""The model card: a registered version's `workflows.json` (what it predicts, from which columns,
where it came from), typed for the registry, the server and the predictor."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StringConstraints

CARD_FILE = "workflows.json"  # beside a model's files: in an exported artifact, a registered version, a fetched copy
MAX_CARD_BYTES = 16 << 20  # a card read back from the store: labels, columns, metrics, lineage
# each name or label a card holds: PATH_MAX, as for the names storage.confine resolves (a layer above)
MAX_TEXT_CHARS = 4096
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]


class ModelCard(BaseModel):
    """The JSON keys of workflows.json, unchanged. Keys this model does not name are kept (extra
    "allow"), and only keys that were present are written back (`to_dict`), so cards of existing
    registries load and are written back with the same keys and values."""

    model_config = ConfigDict(extra="allow")

    task: Text | None = None
    labels: list[Text] = []  # a classifier's: index i is the model's output i (none for a regression)
    text_columns: list[Text] = []  # text tasks: joined into the model's input, in this order
    image_size: int | None = None  # image tasks: the side of the square uint8 tensor the model reads
    image_mean: list[float] | None = None  # image tasks: per-channel normalization of that tensor
    image_std: list[float] | None = None
    label_column: Text | None = None
    max_length: int | None = None  # tokens; required to serve a text model (TextPredictor)
    lineage: dict[str, Any] | None = None  # dataset, source, checkpoint, run
    majority_label: Text | None = None  # the train split's most common label (evaluation baseline)
    val_metrics: dict[str, Any] | None = None
    # set by registry.register
    name: Text | None = None
    version: int | None = None
    artifact_id: Text | None = None  # unique per upload: names the node-local cache entry
    registered_at: Text | None = None
    # not in workflows.json: registry.card attaches the evaluation stored beside the version
    metrics: dict[str, Any] | None = None
    # not in workflows.json either: the promotion gate's decision stored beside the version (promotion.json)
    promotion: dict[str, Any] | None = None

    @classmethod
    def load(cls, model_dir: str) -> ModelCard:
        with open(os.path.join(model_dir, CARD_FILE)) as f:
            return cls.model_validate(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the keys that were given, extras included, none added. Python mode:
        values go to json.dumps as they came (JSON mode would turn a NaN metric into null)."""
        return self.model_dump(exclude_unset=True)


def write_card(card: ModelCard, out_dir: str) -> dict:
    """workflows.json of an artifact; a dict: registering adds the validation metrics and the tracking
    run that trained it."""
    with open(os.path.join(out_dir, CARD_FILE), "w") as f:
        json.dump(card.to_dict(), f, indent=2)
    return card.to_dict()
