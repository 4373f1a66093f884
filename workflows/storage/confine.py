"""Names read back from the store that become places: resolved under the place they were read from,
by plain-name segments, or refused.

The bucket is trusted with data, not with paths: a manifest, a card or a checkpoint's index is
written by the platform, but anyone who can write to the bucket can edit it. A name such an object
holds is read as a relative path below a base the config chose (`relative_under`), never followed
as a URI of its own: no other protocol, bucket or local file, no `..`.
"""

from __future__ import annotations

import os

from workflows.storage.uri import protocol_of

MAX_SEGMENT_BYTES = 255  # a file name's limit on common file systems
MAX_NAME_CHARS = 4096  # a path's (PATH_MAX), and the bound on any text a store object names


def plain_segments(rel: str) -> bool:
    """`rel` is one or more plain names joined by "/": none empty, `.` or `..`, no backslash or NUL,
    none over MAX_SEGMENT_BYTES."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_NAME_CHARS:
        return False
    return all(p not in ("", ".", "..") and "\\" not in p and "\x00" not in p
               and len(p.encode("utf-8", "surrogatepass")) <= MAX_SEGMENT_BYTES for p in rel.split("/"))


def _local(uri: str) -> str:
    return uri.removeprefix("file://")


def relative_under(base: str, name: object) -> str | None:
    """The part of `name` below `base` (a URI or local path the config chose), where `name` lies there
    by plain-name segments and on the same protocol; None for anything else (another protocol,
    bucket or directory, a relative or escaping name, not a string)."""
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or protocol_of(name) != protocol_of(base):
        return None
    if protocol_of(base) == "file":
        root, name = os.path.abspath(os.path.expanduser(_local(base))), _local(name)
        if not os.path.isabs(name):
            return None
    else:
        root = base.rstrip("/")
    root = root.rstrip("/")
    if not name.startswith(root + "/"):
        return None
    rel = name[len(root) + 1:]
    return rel if plain_segments(rel) else None


def shown(value: object, limit: int = 120) -> str:
    """A value read from the store as an error message shows it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def first_error(e) -> str:
    """A pydantic ValidationError of an object read from the store, in one line: the key, what is
    wrong, and the value (cut)."""
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(the whole object)"
    return f"{key}: {err['msg']} (got {shown(err.get('input'))})"
