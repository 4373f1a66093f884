"""The text classifier's HTTP contract: {"instances": [{text column: string}]}, each instance its
text columns and nothing else, not all of them blank (in the schema as in the validator), answered
with the classification prediction (workflows.tasks.contract has the shared request/response models)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from workflows.tasks.contract import (
    JsonInstances,
    classification_prediction,
    request_model,
    response_model,
)

MAX_TEXT_CHARS = 100_000


# Not all of an instance's text fields blank, in the schema as in the validator. JSON Schema has no
# "at least one of these non-empty", so the schema says "not (every field blank)": a `not` over one
# `pattern` per field, the same regex the validator applies. Blank is spelled out as the whitespace
# that Python's `\s` and ECMA's agree on, not `\s` itself: Python's also counts U+001C-U+001F and
# U+0085, ECMA's (and schemathesis' validator, jsonschema-rs) U+FEFF, so the server refused
# "\x1d\x1d" as blank while the schema declared it valid (make reliability's fuzz row found it); an
# explicit class reads alike in every engine. Not an anyOf
# of `\S` patterns: a generator (hypothesis via schemathesis) must then build each field from the
# pattern AND its 100,000-character maxLength, which stalled schemathesis' coverage phase and failed
# its health checks, so the fuzzer barely reached POST /predict; a `not` it satisfies by filtering the
# rare all-blank instance out, and it breaks it by generating blank strings.
BLANK = r"^[\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*$"
_BLANK = re.compile(BLANK)


def instance_model(text_columns: list[str]) -> type[BaseModel]:
    """One instance: the model's text columns, strings, nothing else; not all of them blank."""
    fields: dict[str, Any] = {c: (str, Field(..., max_length=MAX_TEXT_CHARS)) for c in text_columns}

    def not_all_empty(self):
        if all(_BLANK.search(getattr(self, c)) for c in text_columns):  # as a JSON Schema validator applies it
            raise ValueError(f"all text fields are empty ({', '.join(text_columns)})")
        return self

    validators: dict[str, Any] = {"not_all_empty": model_validator(mode="after")(not_all_empty)}
    some_text: dict[str, Any] = {"not": {"properties": {c: {"pattern": BLANK} for c in text_columns}}}
    return create_model("Instance", __config__=ConfigDict(extra="forbid", strict=True, json_schema_extra=some_text),
                        __validators__=validators, **fields)


def example_instance(text_columns: list[str]) -> dict[str, str]:
    return {c: "Return the mean of the array elements along the given axis." for c in text_columns}


def predict_models(card, max_instances: int) -> tuple[type[BaseModel], type[BaseModel]]:
    """(PredictRequest, PredictResponse) of a text classifier `card` describes."""
    request = request_model(instance_model(card.text_columns), max_instances, example_instance(card.text_columns))
    return request, response_model(card, classification_prediction(card.labels))


def text_contract(card, max_instances: int) -> JsonInstances:
    return JsonInstances(instance_model(card.text_columns), classification_prediction(card.labels), card,
                         max_instances, example_instance(card.text_columns))
