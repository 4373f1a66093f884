"""store_hostile_objects: the hostile-store corpus (reliability.store_hostile_cases), run against the
platform's own readers in this process, on a local store (storage.root), with canaries around it:

- a folder outside everything the config names, holding what a hostile name points at (a parquet
  file, a tokenizer, a vocabulary, a tuner.pkl): nothing under it may be opened (a Python audit hook
  sees every open and listing), created or changed;
- a second S3 endpoint (AWS_ENDPOINT_URL for the row, with a bucket `canary`) and an HTTP server,
  each counting the requests it gets: none may come;
- the chat task's serving predictor of a tiny model (the replica's multiplexed loader of LoRA
  adapters, as an HTTP request reaches it): after each adapter refused (a 404), the base answers
  token for token as before, and no adapter id is listed.

Every case must be refused in one line (a UserError, or the replica's 404): `failed` counts those
that were not, or after which the predictor no longer answered as before; `lost` those that read,
wrote or requested anything outside (always 0 to pass).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

from reliability import ROOT, make_row
from reliability.store_hostile_cases import ALL, CANARY_BUCKET, FAST, Case

# --- watching what is opened ---------------------------------------------------------------------------
_WATCH: dict = {"on": False, "under": (), "seen": []}


def _audit(event: str, args) -> None:
    if not _WATCH["on"] or event not in ("open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.mkdir",
                                         "os.symlink", "shutil.copyfile", "shutil.rmtree"):
        return
    # what is opened, listed or changed: os.symlink's first argument is the link's target, not a change
    paths = args[1:2] if event == "os.symlink" else args[:2] if event == "os.rename" else args[:1]
    for path in paths:
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.fsdecode(path)
            if any(path == u or path.startswith(u + os.sep) for u in _WATCH["under"]):
                _WATCH["seen"].append(f"{event} {path}")


_HOOKED = False


@contextmanager
def watching(*under: Path):
    """What the code in the block opens, lists or changes under `under` (a list, filled as it runs)."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)  # for the life of the process: it only looks while a block runs
        _HOOKED = True
    _WATCH.update(on=True, under=tuple(str(Path(u).resolve()) for u in under), seen=[])
    try:
        yield _WATCH["seen"]
    finally:
        _WATCH["on"] = False


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


class _Counting(BaseHTTPRequestHandler):
    hits: Counter = Counter()

    def _any(self):
        type(self).hits[self.path] += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_PUT = do_POST = _any

    def log_message(self, *a):
        pass


# --- the platform, set up ------------------------------------------------------------------------------
class Env:
    """The config, the store and the pristine objects each case starts from (made fresh per case)."""

    def __init__(self, workdir: Path, http: str, ctx_env: dict):
        from workflows.config import WorkflowConfig, load_config
        from workflows.storage.uri import StorageContext

        self.workdir, self.http = workdir, http
        self.outside = workdir / "outside"
        self.store, cache = workdir / "store", workdir / "cache"
        common = {"storage": {"root": str(self.store), "embedded": {"enabled": False}},
                  "cache": {"dir": str(cache)}, "output_dir": str(workdir / "runs")}
        self.cfg = WorkflowConfig.model_validate({**common, "name": "hostile", "data": {"source": str(workdir / "raw")},
                                                  "tune": {"space": {"train.lr": {"grid": [1e-4, 2e-4]}}}})
        self.chat_cfg = load_config(ROOT / "configs" / "chat.yaml", [
            f"storage.root={self.store}", "storage.embedded.enabled=false", f"cache.dir={cache}"])
        self.ctx = StorageContext.from_config(self.cfg.storage)
        self.cache_models = str(Path(self.cfg.cache.resolved_dir()) / "models")
        self.count = itertools.count(1)
        self.tiny = str(workdir / "tiny")
        self.checkpoint = workdir / "pristine-checkpoint"
        self._predictor = None

    # the pristine objects
    def build(self, serving: bool) -> None:
        """The pristine objects; `serving`: the tiny chat model and a LoRA adapter of it too."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from tests.chat_serve_task import build_lora, build_tiny_chat

        self.outside.mkdir()
        pq.write_table(pa.table({"label_id": [7]}), self.outside / "secret.parquet")
        (self.outside / "tokenizer").mkdir()
        (self.outside / "tokenizer" / "config.json").write_text("{}")
        (self.outside / "vocab.txt").write_text("secret\n")
        (self.outside / "tuner.pkl").write_bytes(b"not this user's")
        self.dataset = self.store / "processed" / "d0"
        files = {}
        for split in ("train", "val", "test"):
            (self.dataset / f"split={split}").mkdir(parents=True)
            pq.write_table(pa.table({"label_id": [0, 1]}), self.dataset / f"split={split}" / "part-0.parquet")
            files[split] = [str(self.dataset / f"split={split}" / "part-0.parquet")]
        (self.dataset / "manifest.json").write_text(json.dumps({
            "uri": str(self.dataset), "version": "d0", "labels": ["a", "b"], "label_column": "label", "files": files,
            "counts": {"train": 2, "val": 2, "test": 2}, "label_counts": {}, "source": str(self.workdir / "raw"),
            "task": "classification", "text_columns": ["text"], "tokenizer": "minilm", "max_length": 32}))
        self.artifact = self.workdir / "artifact"
        self.artifact.mkdir()
        (self.artifact / "model.safetensors").write_bytes(b"weights")
        (self.artifact / "vocab.txt").write_text("a\n")
        (self.artifact / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                                         "vocab_file": "vocab.txt"}))
        if serving:
            build_tiny_chat(self.tiny)
            build_lora(self.tiny, self.workdir / "adapter", seed=1)
        self._checkpoint()
        self._search()

    def _checkpoint(self) -> None:
        import torch

        from workflows.train import checkpoint

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        checkpoint.save(str(self.checkpoint), model, optimizer, scheduler, {"epoch": 1, "step": 1})
        assert "weight" in checkpoint.consolidated_model_state(str(self.checkpoint))  # pristine: it reads

    def _search(self) -> None:
        from workflows.tune.state import TUNER_PKL, remember_tuner_state

        self.experiment = f"{self.cfg.uri('tune')}/{self.cfg.name}-tune"
        os.makedirs(self.experiment)
        (Path(self.experiment) / TUNER_PKL).write_bytes(b"the state this user's tune wrote")
        remember_tuner_state(self.cfg, self.experiment, self.ctx)
        self.pristine_search = Path(self.experiment).with_name("pristine-search")
        shutil.copytree(self.experiment, self.pristine_search)

    # fresh copies, one per case
    def fresh_model(self) -> tuple[str, Path]:
        from workflows import registry
        from workflows.model_card import CARD_FILE

        ref = registry.register(self.cfg, self.ctx, str(self.artifact), "m", {
            "task": "classification", "labels": ["a", "b"], "text_columns": ["text"],
            "lineage": {"dataset_uri": str(self.dataset)},
            "base": {"name_or_path": "registry:tiny:1", "sha256": "0" * 64}})
        return f"m:{ref.version}", Path(ref.uri) / CARD_FILE

    def writer_cfg(self):
        """The config of a bucket writer with a signing key of their own (not in registry.trusted_keys)."""
        from workflows import registry_signing

        key = self.workdir / "writer-key.pem"
        if not key.exists():
            key.write_bytes(registry_signing.new_private_key())
        return self.cfg.model_copy(update={"registry": self.cfg.registry.model_copy(
            update={"signing_key": str(key)})})

    def other_version_record(self, file: str) -> dict:
        """A record `file` signed for another version (the store's first): what a writer could copy."""
        from workflows import registry

        if not hasattr(self, "_first"):
            self._first = registry.resolve(self.cfg, self.ctx, self.fresh_model()[0])
        registry.write_promotion(self.cfg, self.ctx, self._first, {"promoted": True, "reason": "first"}) \
            if file == registry.PROMOTION_FILE else \
            registry.write_evaluation(self.cfg, self.ctx, self._first, {"f1": 0.99})
        return json.loads((Path(self._first.uri) / file).read_text())

    def other_alias_record(self, alias: str, version: int) -> str:
        """The first move of `alias` of another model, signed for that model: what a writer could copy."""
        from workflows import registry

        other = "other"
        if other not in registry.list_models(self.cfg, self.ctx):
            registry.register(self.cfg, self.ctx, str(self.artifact), other, {"task": "classification",
                                                                               "labels": ["a", "b"]})
        registry.move_alias(self.cfg, self.ctx, other, alias, 1, by="the gate")
        return (self.store / "models" / other / "aliases" / alias / "00000001.json").read_text()

    def fresh_dataset(self) -> str:
        return str(shutil.copytree(self.dataset, self.store / "processed" / f"d{next(self.count)}"))

    def fresh_checkpoint(self) -> Path:
        return Path(shutil.copytree(self.checkpoint, self.workdir / "runs" / f"checkpoint-{next(self.count)}"))

    def fresh_search(self) -> tuple[str, Path]:
        from workflows.tune.state import TUNER_PKL

        shutil.rmtree(self.experiment)
        shutil.copytree(self.pristine_search, self.experiment)
        return self.experiment, Path(self.experiment) / TUNER_PKL

    def check_tuner_state(self, uri: str) -> None:
        from workflows.tune.state import check_tuner_state

        check_tuner_state(self.cfg, uri, self.ctx)

    # the served replica
    @property
    def predictor(self):
        if self._predictor is None:
            from workflows.tasks.chat import ChatTask
            from workflows.tasks.chat.serving import ChatPredictor

            # one torch thread, as a replica of one CPU has (and no contention with the decode thread)
            self._predictor = ChatPredictor(ChatTask(self.chat_cfg), self.tiny, SimpleNamespace(name="tiny", version=1),
                                            threads=1)
            self._predictor.engine.eos = set()
            self.base_answer = self.answer()
        return self._predictor

    def answer(self) -> list[int]:
        from workflows.tasks.chat.engine import SamplingParams

        p = self.predictor
        gen = p.engine.submit(p.prompts.tokenizer("hello world the cat sat").input_ids, SamplingParams(max_tokens=4,
                                                                                              temperature=0))
        gen.result(60)
        return gen.tokens

    def load_adapter(self, config: dict | None = None, weights_key: str | None = None) -> None:
        """Register the good adapter with `config` keys (or a weight named `weights_key`) changed, and
        load it as a request naming it does: the replica's multiplexed loader (a 404 when refused)."""
        from safetensors.torch import load_file, save_file

        from workflows import registry
        from workflows.serve.app import ModelServer
        from workflows.tasks.chat.openai.routes import Adapters
        from workflows.tasks.chat.training.model import weights_sha256

        folder = Path(shutil.copytree(self.workdir / "adapter", self.workdir / f"adapter-{next(self.count)}"))
        if config:
            doc = json.loads((folder / "adapter_config.json").read_text())
            doc.update(config)
            (folder / "adapter_config.json").write_text(json.dumps(doc))
        if weights_key:
            weights = load_file(folder / "adapter_model.safetensors")
            weights[weights_key] = next(iter(weights.values())).clone()
            save_file(weights, folder / "adapter_model.safetensors")
        card = {"task": "chat", "export": "adapter", "base": {"name_or_path": "registry:tiny:1",
                                                              "sha256": weights_sha256(self.tiny)}}
        ref = registry.register(self.chat_cfg, self.ctx, str(folder), "hostile", card)
        deployment: Any = ModelServer  # a serve.Deployment: its class is func_or_class
        server = deployment.func_or_class
        fake = SimpleNamespace(cfg=self.chat_cfg, storage=self.ctx)
        adapters = Adapters(SimpleNamespace(predictor=self.predictor,
                                            read_card=lambda spec: server.read_card(fake, spec),
                                            fetch_model=lambda spec: server.fetch_model(fake, spec)))
        asyncio.run(adapters.load(f"hostile:{ref.version}"))

    def close(self) -> None:
        if self._predictor is not None:
            self._predictor.close()


# --- the row --------------------------------------------------------------------------------------------
def store_hostile_objects(workdir: Path, seed: int = 0, full: bool = False) -> dict:
    """The corpus (`full`: with the LoRA adapters the serving predictor loads; else the fast subset)."""
    from tests.s3_behaviour import BehaviourStore
    from workflows.errors import UserError

    refusals: tuple[type[BaseException], ...] = (UserError,)
    if full:  # the replica's 404
        from workflows.tasks.chat.engine import ModelNotFound

        refusals = (UserError, ModelNotFound)

    t0 = time.time()
    with ExitStack() as stack:
        canary_s3 = stack.enter_context(BehaviourStore())
        http = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
        threading.Thread(target=http.serve_forever, daemon=True).start()
        stack.callback(http.shutdown)
        env_vars = {"AWS_ENDPOINT_URL": canary_s3.url, "AWS_ACCESS_KEY_ID": "canary", "AWS_SECRET_ACCESS_KEY": "canary",
                    "AWS_REGION": "us-east-1"}
        stack.enter_context(mock.patch.dict(os.environ, env_vars))  # restored after
        client = canary_s3.context().boto3_client()
        client.create_bucket(Bucket=CANARY_BUCKET)
        for name in ("secret.parquet", "tokenizer/config.json", "vocab.txt", "dataset/manifest.json",
                     "base/config.json"):
            client.put_object(Bucket=CANARY_BUCKET, Key=name, Body=b"{}")
        env = Env(workdir, f"http://127.0.0.1:{http.server_address[1]}", env_vars)
        stack.callback(env.close)
        env.build(serving=full)
        cases = [c for make in (ALL if full else FAST) for c in make(env)]
        results = [_run(env, case, canary_s3, refusals) for case in cases]
    refused = [r for r in results if r["refused"]]
    failures = [f"{r['case']}: {r['problem']}" for r in results if r["problem"]]
    lost = [r for r in results if r["outside"]]
    by_obj = Counter(r["obj"] for r in results)
    by_variant = Counter(r["variant"] for r in results)
    subset = "" if full else "fast subset (no LoRA adapters): "
    detail = (f"{subset}{len(results)} hostile objects read back from a local store (storage.root) by the platform's "
              f"own readers: {', '.join(f'{n} {o}' for o, n in by_obj.items())}; fields set to "
              f"{', '.join(f'{v} ({n})' for v, n in by_variant.items())}; {len(refused)} refused in one line; "
              f"{len(lost)} read, wrote or requested outside what the config allows (a folder outside it watched by "
              f"an audit hook, a canary S3 endpoint and HTTP server: {sum(r['requests'] for r in results)} "
              "requests)")
    if full:
        detail += (f"; the serving predictor answered the base model as before after each of the "
                   f"{sum(r['serving'] for r in results)} adapters a request named")
    if failures:
        detail += f"; not refused in one line: {'; '.join(failures[:5])}"
    if lost:
        where = "; ".join(f"{r['case']}: {r['outside']}" for r in lost[:3])
        detail += f"; outside: {where}"
    return make_row("store_hostile_objects", injected=len(results), survived=len(refused) - len(failures),
                    failed=len(failures), allowed_failures=0, lost=len(lost), detail=detail,
                    failures=failures, cases=len(results), objects=dict(by_obj), variants=dict(by_variant),
                    seconds=round(time.time() - t0, 1))


def _run(env: Env, case: Case, canary_s3, refusals) -> dict:
    name = f"{case.obj} {case.field} = {case.variant}"
    before = _snapshot(env.outside)
    requests_before = sum(canary_s3.behaviour.seen.values()) + sum(_Counting.hits.values())
    error: BaseException | None = None
    with watching(env.outside) as seen:
        try:
            case.run()
        except BaseException as e:  # noqa: BLE001 - what the reader raised is the outcome
            error = e
    requests = sum(canary_s3.behaviour.seen.values()) + sum(_Counting.hits.values()) - requests_before
    changed = _snapshot(env.outside) != before
    message = str(error) if error is not None else ""
    refused = isinstance(error, refusals) and len(message.splitlines()) == 1
    problem = None
    if error is None:
        problem = "accepted"
    elif not refused:
        problem = f"{type(error).__name__}: {message.splitlines()[0][:200] if message else ''}"
    elif case.serving and (env.answer() != env.base_answer or any(k.startswith("hostile:")
                                                                  for k in env.predictor.adapters)):
        problem = "the served base no longer answers as before"
    outside = [*seen[:2], *(["outside folder changed"] if changed else []),
               *([f"{requests} requests to the canaries"] if requests else [])]
    return {"case": name, "obj": case.obj, "variant": case.variant, "refused": refused, "problem": problem,
            "outside": "; ".join(outside), "requests": requests, "serving": case.serving}
