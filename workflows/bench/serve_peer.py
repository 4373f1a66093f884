"""The peer `workflows bench serve` holds Ray Serve against: what a user writes in 40 lines.

A plain FastAPI app under uvicorn, one process, with the same Predictor (same threads), the same
body validation (workflows.serve.contract) and an asyncio micro-batcher equivalent to
@serve.batch (at most `max_batch` instances, no idle wait: a batch takes what queued while the
previous one ran; the model call runs in a thread so the event loop keeps reading requests).
It belongs to the bench, not the product.

`python -m workflows.bench.serve_peer MODEL_DIR PORT THREADS MAX_BATCH NAME VERSION` serves on
127.0.0.1:PORT.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` annotation.
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path


def make_app(model_dir: str, threads: int, max_batch: int, name: str, version: int):
    import json
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError

    from workflows.serve.contract import instance_model
    from workflows.serve.predictor import Predictor

    predictor = Predictor(model_dir, threads=threads)
    instance = instance_model(predictor.text_columns)
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
        try:
            rows = [instance.model_validate(i).model_dump() for i in json.loads(await request.body())["instances"]]
        except (ValueError, KeyError, TypeError, ValidationError) as e:
            return JSONResponse({"error": str(e)[:200]}, status_code=422)
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

    def __init__(self, model_dir: str, port: int, threads: int, max_batch: int, spec: str, log: Path):
        name, version = spec.split(":")
        self.args = [sys.executable, "-m", "workflows.bench.serve_peer", model_dir, str(port), str(threads),
                     str(max_batch), name, version]
        self.url, self.log = f"http://127.0.0.1:{port}", log

    def __enter__(self) -> "Peer":
        import requests

        self.log.parent.mkdir(parents=True, exist_ok=True)
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

    model_dir, port, threads, max_batch, name, version = argv[0], *map(int, argv[1:4]), argv[4], int(argv[5])
    app = make_app(model_dir, threads, max_batch, name, version)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
