"""What every config section shares: unknown keys are errors, and names that become parts of paths
are checked."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(value: str, what: str = "name") -> str:
    """Names that become parts of paths/URIs: no separators, no '..', no leading dot."""
    if not NAME_RE.match(value) or ".." in value:
        raise ValueError(
            f"invalid {what} {value!r}: use 1-64 letters, digits, '_', '-', '.', starting with a letter or digit"
        )
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

