"""The peer `workflows bench serve` holds Ray Serve against: what a user writes in 40 lines.

A plain FastAPI app under uvicorn, one process, with the same predictor (the model's task builds
it, with the same threads and precision), the same body parsing and validation (the task's HTTP
contract: a text row validated, an image decoded, before any batch) and an asyncio micro-batcher
equivalent to @serve.batch (at most `max_batch` instances, no idle wait: a batch takes what queued
while the previous one ran; the model call runs in a thread so the event loop keeps reading
requests). It belongs to the bench, not the product.

`python -m workflows.bench.serve_peer MODEL_DIR PORT THREADS MAX_BATCH NAME VERSION [CONFIG_JSON]`
serves on 127.0.0.1:PORT; CONFIG_JSON is a workflow config dumped as JSON (default: the quickstart's).
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` annotation.
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path


def make_app(model_dir: str, threads: int, max_batch: int, name: str, version: int, cfg=None):
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from workflows.config import load_config
    from workflows.model_card import ModelCard
    from workflows.tasks import task_for_card

    cfg = cfg or load_config("quickstart", [])
    card = ModelCard.load(model_dir)
    task = task_for_card(cfg, card)
    predictor = task.serving.predictor(model_dir, card, threads=threads, precision=cfg.serve.precision)
    contract = task.serving.http_contract(card, cfg.serve.max_instances)
    queue: asyncio.Queue = asyncio.Queue()
    executor = ThreadPoolExecutor(1)

    async def batcher():
        loop = asyncio.get_running_loop()
        while True:
            items = [await queue.get()]
            while len(items) < max_batch and not queue.empty():
                items.append(queue.get_nowait())
            try:
                out = await loop.run_in_executor(executor, predictor.predict, [row for row, _ in items])
                for (_, fut), pred in zip(items, out):
                    fut.set_result(pred)
            except Exception as e:  # noqa: BLE001  (each waiting request gets the error)
                for _, fut in items:
                    fut.set_exception(e)

    @asynccontextmanager
    async def lifespan(_):
        task = asyncio.create_task(batcher())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.post("/predict")
    async def predict(request: Request):
        rows = contract.parse(request.headers.get("content-type"), await request.body())
        if isinstance(rows, tuple):  # (status, message): not a valid request
            return JSONResponse({"error": rows[1]}, status_code=rows[0])
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in rows]
        for row, fut in zip(rows, futs):
            queue.put_nowait((row, fut))
        return JSONResponse({"predictions": list(await asyncio.gather(*futs)), "model": name, "version": version})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    return app


class Peer:
    """The peer server in a process of its own, for the duration of a `with` block."""

    def __init__(self, model_dir: str, port: int, threads: int, max_batch: int, spec: str, log: Path, cfg=None):
        name, version = spec.split(":")
        self.args = [sys.executable, "-m", "workflows.bench.serve_peer", model_dir, str(port), str(threads),
                     str(max_batch), name, version]
        self.url, self.log, self.cfg = f"http://127.0.0.1:{port}", log, cfg

    def __enter__(self) -> "Peer":
        import requests

        self.log.parent.mkdir(parents=True, exist_ok=True)
        if self.cfg is not None:  # the config the peer builds the task from, beside its log
            config = self.log.with_suffix(".config.json")
            config.write_text(self.cfg.model_dump_json())
            self.args.append(str(config))
        with open(self.log, "w") as sink:
            self.proc = subprocess.Popen(self.args, stdout=sink, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if requests.get(f"{self.url}/healthz", timeout=2).ok:
                    return self
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the peer server did not start: {self.log.read_text()[-2000:]}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str]) -> None:
    import uvicorn

    from workflows.config import WorkflowConfig

    model_dir, port, threads, max_batch, name, version = argv[0], *map(int, argv[1:4]), argv[4], int(argv[5])
    cfg = WorkflowConfig.model_validate_json(Path(argv[6]).read_text()) if len(argv) > 6 else None
    app = make_app(model_dir, threads, max_batch, name, version, cfg)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
