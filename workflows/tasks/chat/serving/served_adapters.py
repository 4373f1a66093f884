"""The LoRA adapters a replica serves beside its base: a request whose "model" is another registered
version, NAME:VERSION, is answered by the served base with that adapter.

An adapter is accepted only when its card is a chat task's adapter export whose `base.sha256` is the
sha256 of the served base's weights (the served model's own weights, or, for a served adapter, its
card's base), and its version directory holds peft's two files (`check_card` before anything is
downloaded, `check_files` after). It loads in the engine's decode thread, between steps, through
workflows.tasks.chat.adapters (its config rebuilt from an allow-list, its weights from safetensors only).
Ray Serve's model multiplexing decides which adapters a replica holds (the OpenAI routes' loader); one
it unloads is deleted from the model only once no request uses it.
"""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from workflows.tasks.chat.adapters import ADAPTER_FILES, is_adapter, load_adapter, remove_adapter
from workflows.tasks.chat.engine import Engine, ModelNotFound
from workflows.tasks.chat.training.model import weights_sha256

SERVED_ADAPTER = "default"  # peft's name for the adapter a served adapter version loads as
# a registered version as a request names it (registry names: workflows.config.check_name)
MODEL_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})(?::v?(\d{1,9}))?$")


class ServedAdapters(Mapping[str, str]):
    """The adapters loaded (or loading), model id (NAME:VERSION) -> peft adapter name, of the model in
    `model_dir` registered as `card`; `engine` gives the served engine (loaded on first use); `lock` is
    the predictor's."""

    def __init__(self, model_dir: str, card: Any, engine: Callable[[], Engine], lock: threading.RLock):
        self.model_dir, self.card, self._engine, self._lock = model_dir, card, engine, lock
        self.base_id = f"{card.name}:{card.version}"
        self.served_adapter = SERVED_ADAPTER if is_adapter(model_dir) else None  # the engine's name for it
        self._names: dict[str, str] = {}
        self._loaded: set[str] = set()  # peft names whose weights are all in (decode thread only)
        self._using: Counter[str] = Counter()  # model id -> requests using it (event loop only)
        self._retiring: set[str] = set()  # unloaded by Serve, deleted once unused
        self._count = 0
        self._base_sha: str | None = None

    def __getitem__(self, model_id: str) -> str:
        return self._names[model_id]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))  # a copy: the event loop may add or remove adapters meanwhile

    def __len__(self) -> int:
        return len(self._names)

    # --- which model a request names ----------------------------------------------------------------
    def resolve(self, model: str) -> str | None:
        """None for the served base model (its name, or NAME:VERSION), else the adapter's model id
        NAME:VERSION; ModelNotFound for what cannot name a registered version."""
        m = MODEL_ID.match(model)
        if not m:
            raise ModelNotFound(f"model {model[:80]!r} is not a registered model NAME:VERSION")
        name, version = m.group(1), m.group(2)
        if name == self.card.name and (version is None or int(version) == self.card.version):
            return None
        if version is None:
            raise ModelNotFound(f"model {name!r}: name an adapter with its version, {name}:VERSION")
        return f"{name}:{int(version)}"

    def model_id(self, adapter: str | None) -> str:
        """The model id (NAME:VERSION) a request with this peft adapter name asked for: the served one for
        the base (or a served adapter), else the adapter's."""
        if adapter is None or adapter == self.served_adapter:
            return self.base_id
        # a copy in one step (the event loop may add or remove adapters meanwhile; the engine thread asks)
        return next((m for m, name in list(self._names.items()) if name == adapter), adapter)

    # --- which adapters this replica may load -------------------------------------------------------
    def base_sha256(self) -> str:
        """The sha256 of the served base's weights: a served adapter's card names it; else its own."""
        if self._base_sha is None:
            base = dict(getattr(self.card, "base", None) or {})
            self._base_sha = str(base.get("sha256") or "") if self.served_adapter else weights_sha256(self.model_dir)
        return self._base_sha

    def check_card(self, model_id: str, card: Any) -> None:
        """Before anything is downloaded: the card of a chat task's adapter export of the served base
        (its base weights' sha256), or ModelNotFound."""
        tasks = {"chat", getattr(self.card, "task", None) or "chat"}  # the served card's: a chat task's subclass
        if getattr(card, "task", None) not in tasks or getattr(card, "export", None) != "adapter":
            raise ModelNotFound(f"model {model_id} is not a LoRA adapter of the chat task (task "
                                f"{getattr(card, 'task', None)!r}, export {getattr(card, 'export', None)!r})")
        self._check_base(model_id, card)

    def check_files(self, model_id: str, model_dir: str, card: Any) -> None:
        """A registered version this replica may load as an adapter of its base, or ModelNotFound."""
        missing = [f for f in ADAPTER_FILES if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise ModelNotFound(f"model {model_id} is not a LoRA adapter (no {', '.join(missing)})")
        self._check_base(model_id, card)

    def _check_base(self, model_id: str, card: Any) -> None:
        base = dict(getattr(card, "base", None) or {})
        if not base.get("sha256") or base["sha256"] != self.base_sha256():  # its base's name is a place: unsaid
            raise ModelNotFound(f"model {model_id} is an adapter of another base (weights sha256 "
                                f"{str(base.get('sha256') or '?')[:12]}...), not of the base served by {self.base_id} "
                                f"({self.base_sha256()[:12]}...)")

    # --- loading and unloading ----------------------------------------------------------------------
    def add(self, model_id: str, model_dir: str):
        """Load an adapter in the decode thread, between steps (a Future of its peft name), through
        `load_adapter` (its config rebuilt from an allow-list, its weights from safetensors only). One
        that fails to load leaves nothing: neither a listed model id nor a half-loaded adapter."""
        with self._lock:
            self._count += 1
            name = self._names.setdefault(model_id, f"adapter{self._count}")
        self._retiring.discard(model_id)
        engine = self._engine()

        if hasattr(engine, "add_adapter"):  # an engine that loads adapter files itself (vLLM's): checked there
            return self._add_files(engine, model_id, model_dir, name)

        def load():
            if name not in self._loaded:
                try:
                    engine.model = load_adapter(engine.model, model_dir, name).eval()
                except BaseException:
                    with self._lock:
                        if self._names.get(model_id) == name:
                            del self._names[model_id]
                    raise
                self._loaded.add(name)
            with self._lock:  # a load of the same id that failed first took it off
                self._names[model_id] = name
            return name

        return engine.call(load)

    def _add_files(self, engine, model_id: str, model_dir: str, name: str):
        """`add` for an engine that loads an adapter's files itself (its `add_adapter`: vLLM's, which reads
        the files our checks rewrote): a Future of its name, and nothing listed if it fails."""
        from concurrent.futures import Future

        done: Future = Future()

        def loaded(fut):
            if fut.exception() is not None:
                with self._lock:
                    if self._names.get(model_id) == name:
                        del self._names[model_id]
                done.set_exception(fut.exception())
            else:
                self._loaded.add(name)
                with self._lock:  # a load of the same id that failed first took it off
                    self._names[model_id] = name
                done.set_result(name)

        if name in self._loaded:
            done.set_result(name)
        else:
            engine.add_adapter(name, model_dir).add_done_callback(loaded)
        return done

    def using(self, model_id: str | None, delta: int) -> None:
        """A request starts (+1) or stops (-1) using an adapter; on the event loop."""
        if model_id is None:
            return
        self._using[model_id] += delta
        if self._using[model_id] <= 0:
            del self._using[model_id]
            if model_id in self._retiring:
                self._delete(model_id)

    def retire(self, model_id: str) -> None:
        """Serve unloaded the adapter (on the event loop): delete it now, or when its last request ends."""
        if model_id not in self._names:
            return
        if self._using[model_id] > 0:
            self._retiring.add(model_id)
        else:
            self._delete(model_id)

    def _delete(self, model_id: str) -> None:
        self._retiring.discard(model_id)
        with self._lock:
            name = self._names.pop(model_id, None)
        engine = self._engine()

        if hasattr(engine, "remove_adapter"):
            self._loaded.discard(name)
            engine.remove_adapter(name)
            return

        def delete():
            model = engine.model
            self._loaded.discard(name)
            if name in getattr(model, "peft_config", {}):  # the last adapter of a whole model: unwrapped
                engine.model = remove_adapter(model, name, unwrap=self.served_adapter is None)

        engine.call(delete)
