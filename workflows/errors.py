"""Errors a user can fix: the CLI prints them as one line, without a traceback."""

from __future__ import annotations

import contextlib
import re


class UserError(Exception):
    """Bad input (config, URI, model name, data): the message says what and where."""


class StoreUnreachable(UserError):
    """The object store did not answer (storage.uri.reaching): a reader with a copy of its own may go on."""


_IN_TRACEBACK = re.compile(r"^workflows\.errors\.(?:UserError|StoreUnreachable): (.+)$", re.M)


def find_user_error(exc: BaseException) -> UserError | None:
    """A UserError raised here or inside a Ray task/actor/worker (Ray wraps those)."""
    seen = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        # Ray Data wraps a UDF's exception in UserCodeException and the original is not carried
        # over to the driver, only its traceback text; our messages are one line.
        text = getattr(e, "traceback_str", None) or (str(e) if type(e).__module__.startswith("ray.") else "")
        match = _IN_TRACEBACK.search(text)
        if match:
            return UserError(match.group(1))
        stack.extend([e.__cause__, e.__context__, getattr(e, "cause", None)])
        for attr in ("worker_failures", "errors"):  # Ray Train's worker-group errors
            v = getattr(e, attr, None)
            if isinstance(v, dict):
                stack.extend(x for x in v.values() if isinstance(x, BaseException))
    return None


@contextlib.contextmanager
def surface_user_errors():
    """Re-raise a UserError that a Ray task raised as itself, not wrapped in Ray's errors."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        found = find_user_error(e)
        if found is None:
            raise
        raise UserError(str(found)) from None
