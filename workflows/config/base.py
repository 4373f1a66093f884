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



# what would read as a version (3, v3) or the newest version in NAME@ALIAS: never an alias
_VERSION_LIKE = re.compile(r"^(v?\d+|latest)$", re.IGNORECASE)


def check_alias_name(value: str) -> str:
    """A registry alias (`production`): a valid name that cannot read as a version."""
    check_name(value, "alias")
    if _VERSION_LIKE.match(value):
        raise ValueError(f"invalid alias {value!r}: it would read as a version; use a name such as production")
    return value
