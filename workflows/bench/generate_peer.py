"""The generation bench's one-at-a-time peer, in a process of its own: plain Hugging Face `generate` behind
a minimal OpenAI-compatible FastAPI app (uvicorn, 127.0.0.1), one request decoded at a time, streaming
each token as an SSE chunk, so that the bench's client (workflows.bench.generate_client) drives it as it
drives every other server.

    python -m workflows.bench.generate_peer --model-dir DIR --port PORT [--threads N]

POST /v1/chat/completions reads "messages" (the model's chat template), "max_tokens", "temperature",
"top_p", "seed", "ignore_eos" (then exactly max_tokens tokens) and answers SSE only; GET /health.
"""

# No `from __future__ import annotations`: the FastAPI route must see the real `Request` annotation.
import argparse
import json
import queue
import threading


def build_app(model, tokenizer, eos: int):
    import torch
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app, lock = FastAPI(), threading.Lock()

    class Tokens:  # transformers' streamer protocol: put(prompt ids) first, then each new token
        def __init__(self):
            self.q: queue.SimpleQueue = queue.SimpleQueue()
            self.started = False

        def put(self, value):
            if self.started:
                self.q.put(int(value.reshape(-1)[0]))
            self.started = True

        def end(self):
            self.q.put(None)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        ids = torch.tensor([tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)])
        n, temperature = int(body.get("max_tokens") or 64), float(body.get("temperature", 1.0))
        tokens = Tokens()

        def work():
            kwargs = {"do_sample": True, "temperature": temperature, "top_p": float(body.get("top_p", 1.0))} \
                if temperature > 0 else {"do_sample": False}
            with lock, torch.inference_mode():
                if body.get("seed") is not None:
                    torch.manual_seed(int(body["seed"]))
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, max_new_tokens=n,
                               min_new_tokens=n if body.get("ignore_eos") else 0, pad_token_id=eos, streamer=tokens,
                               **kwargs)

        threading.Thread(target=work, daemon=True).start()

        def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
            out = {"id": "peer", "object": "chat.completion.chunk", "created": 0, "model": body.get("model", "peer"),
                   "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if usage:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        def stream():
            count, last = 0, None
            yield chunk({"role": "assistant", "content": ""})
            while (token := tokens.q.get()) is not None:
                count, last = count + 1, token
                yield chunk({"content": tokenizer.decode([token], skip_special_tokens=True) or " "})
            finish = "stop" if last == eos and count < n else "length"
            yield chunk({}, finish)
            yield chunk({}, usage={"prompt_tokens": ids.shape[1], "completion_tokens": count,
                                   "total_tokens": ids.shape[1] + count})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main() -> None:
    import torch
    import uvicorn

    from workflows.tasks.chat.training.model import load_causal_lm, load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm(args.model_dir).eval(), load_tokenizer(args.model_dir)
    uvicorn.run(build_app(model, tokenizer, int(tokenizer.eos_token_id)), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
