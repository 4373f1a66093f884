"""`workflows serve --model NAME@ALIAS` follows the alias: a thread of the serving command reads each
served alias every `serve.alias_poll_s` and, when it points at another version, deploys that version
to the same application. That is Ray Serve's rolling update: the new version's replicas start and
become ready, then the old ones drain (their in-flight requests answered) and stop, so no request
fails while it happens. A rollback is the alias moved back. An alias that is removed leaves the
served version in place (with a warning): serving never stops because of a registry edit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workflows import registry, registry_aliases
from workflows.errors import UserError
from workflows.serve import app


@dataclass
class Followed:
    """One served alias: NAME@ALIAS, the version its application serves, where it is deployed."""

    spec: str
    version: int
    app_name: str
    route_prefix: str
    rollovers: list[dict[str, Any]] = field(default_factory=list)


class AliasFollower:
    def __init__(self, rt, served: list[Followed], say: Callable[[str], None],
                 on_change: Callable[[], None] | None = None):
        self.rt, self.served, self.say, self.on_change = rt, served, say, on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="alias-follower", daemon=True)
        self._warned: set[str] = set()
        self._last: dict[str, str] = {}  # the spec's last failure said

    def start(self) -> AliasFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.rt.cfg.serve.alias_poll_s):
            for f in self.served:
                try:
                    self.check(f)
                except Exception as e:  # a store blip, a refused record, a failed deploy: tried again next time
                    said = f"serve: following {f.spec}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    if self._last.get(f.spec) != said:  # said once, not at every poll
                        self._last[f.spec] = said
                        self.say(said)
                else:
                    self._last.pop(f.spec, None)

    def check(self, f: Followed) -> dict[str, Any] | None:
        """Roll `f` over if its alias moved; the rollover's record, or None."""
        name, alias = f.spec.split("@", 1)
        record = registry_aliases.newest(self.rt.cfg, self.rt.storage, name, alias)
        if record is None or record.version is None:
            if f.spec not in self._warned:
                self._warned.add(f.spec)
                self.say(f"serve: {f.spec} is not set any more; still serving v{f.version}")
            return None
        self._warned.discard(f.spec)
        if record.version == f.version:
            return None
        registry.resolve(self.rt.cfg, self.rt.storage, f"{name}:{record.version}")  # a complete version
        old, seen = f.version, time.time()
        self.say(f"serve: {f.spec} moved v{old} -> v{record.version} ({registry_aliases.when(record)}, by "
                 f"{record.by}): rolling over")
        t0 = time.perf_counter()
        app.deploy(self.rt.cfg, f"{name}:{record.version}", name=f.app_name, route_prefix=f.route_prefix,
               served_as=f.spec)
        f.version = record.version
        done = {"from": old, "to": record.version, "move": record.seq, "seen_at": seen,
                "deploy_seconds": round(time.perf_counter() - t0, 2)}
        f.rollovers.append(done)
        self.say(f"serve: {f.spec} serves v{record.version} (rolled over in {done['deploy_seconds']:.1f}s)")
        if self.on_change is not None:
            self.on_change()
        return done


def follow_aliases(rt, served: list[dict], say: Callable[[str], None],
                   on_change: Callable[[], None] | None = None) -> AliasFollower | None:
    """A started follower for the served applications (stage_serve's results) that an alias chose;
    None when none did."""
    followed = []
    for s in served:
        if s.get("served_as"):
            name, version = registry.parse_spec(s["model"])
            if version is None:
                raise UserError(f"served model {s['model']} has no version")
            followed.append(Followed(s["served_as"], version, s["app_name"], s["route_prefix"]))
    return AliasFollower(rt, followed, say, on_change).start() if followed else None
