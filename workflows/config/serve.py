"""The `serve` section: the Ray Serve deployment, its autoscaling and its request limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from workflows.config.base import Strict


class AutoscalingConfig(Strict):
    """Ray Serve autoscaling of the model deployment (replaces serve.num_replicas when set)."""

    min_replicas: int = Field(1, ge=0, description="0 lets an idle deployment scale to zero")
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8, gt=0, description="per replica; high enough for batches to fill")
    upscale_delay_s: float = Field(
        30.0, ge=0, description="load must stay above target this long before a replica is added"
    )
    downscale_delay_s: float = Field(
        600.0, ge=0, description="load must stay below target this long before a replica is removed"
    )

    @model_validator(mode="after")
    def _order(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        return self


class GenerateConfig(Strict):
    """Generative models (the chat task's OpenAI-compatible routes): the continuous-batching engine of
    each replica and the limits of a request."""

    max_tokens: int = Field(512, ge=1, description="the most new tokens one request may ask for (max_tokens above "
                            "it is a 400 naming the field); also what a request that names none gets")
    max_prompt_tokens: int = Field(2048, ge=1, description="the longest prompt (in tokens, after the chat template) "
                                   "a request may send: a longer one is a 400 with OpenAI's code "
                                   "context_length_exceeded, before any compute; with max_tokens it bounds the KV "
                                   "cache of a replica (max_batch x (max_prompt_tokens + max_tokens) positions)")
    max_stop_chars: int = Field(128, ge=1, description="the longest stop string a request may send (at most 4 of "
                                "them): a longer one is a 400 naming `stop` (matching costs grow with their length)")
    max_n: int = Field(8, ge=1, description="the most choices one request may ask for (n, times the prompts of a "
                       "text completion), each a row of the batch")
    max_batch: int = Field(8, ge=1, description="requests decoded together in each step of a replica (the KV "
                           "cache's slots)")
    max_queue: int = Field(32, ge=0, description="requests waiting for a place in a full batch; one more is "
                           "answered 429 with Retry-After at once (never queued without bound)")
    retry_after_s: int = Field(1, ge=1, description="the Retry-After of a 429 for a full queue")
    timeout_s: float | None = Field(300.0, gt=0, description="each request's deadline from its arrival at the "
                                    "replica (planning its prompt and grammar counts): past it, waiting or "
                                    "generating, it ends with finish_reason \"timeout\" and the text so far; null: "
                                    "no deadline")
    max_schema_bytes: int = Field(65536, ge=256, description="the largest JSON schema a request may send (each of "
                                  "response_format's and tools' parameters, and all of them together, as compact "
                                  "JSON): a larger one is a 400 naming the field (a grammar's compile time grows "
                                  "with its schema)")
    mixed_step_ratio: float | None = Field(1.5, gt=1, description="while other requests decode, a step prefills the "
                                    "prompt tokens whose cost, learned from the steps that ran, keeps it within this "
                                    "many times a decode-only step of the same requests, however many join (at least "
                                    "one token): a stream's token gap stays within about this ratio while prompts "
                                    "join; higher prefills faster (a sooner first token) with wider gaps; null: "
                                    "prefill_chunk's token budget always")
    prefill_chunk: int = Field(24, ge=1, description="until a replica's step costs are learned (its first "
                               "steps), a step beside decoding requests prefills at most prefill_chunk prompt tokens "
                               "plus one per decoding request, and prefill_chunk more for each joining request "
                               "beyond the decoding ones (fewer where the decode-only steps of batches of "
                               "different sizes measured so far price a prompt token as a decoding row above "
                               "mixed_step_ratio's budget): about the prompt tokens whose compute costs as much as "
                               "reading the weights once (a dozen or two on a CPU, e.g. 512 on a GPU)")
    max_prefill_tokens: int = Field(2048, ge=1, description="prompt tokens prefilled in a step when no request is "
                                    "decoding, or a wave joins (prefill_wave): requests that arrive together are "
                                    "prefilled together, in one forward")
    prefill_wave: float | None = Field(2.0, ge=1, description="a step whose joining requests (still prefilling) "
                                       "are at least this many times those decoding prefills them as a wave, up to "
                                       "max_prefill_tokens, beyond mixed_step_ratio's budget: the few decoding "
                                       "requests' gap grows by that one step, and the batch does not run part-empty "
                                       "while a wave joins a few tokens a step (then ending as staggered); null: "
                                       "never")
    join_wait_s: float = Field(0.1, ge=0, description="with no request decoding, a step waits up to this long "
                               "(from the batch emptying or the oldest waiting request's arrival) for the requests "
                               "still being planned and for the next ones of the clients whose requests just "
                               "ended, so that requests arriving a few milliseconds apart join in one step, not "
                               "one alone and the rest beside it on the time budget; a lone client's next request "
                               "does not wait; 0: never wait")
    prepack_weights: bool = Field(True, description="on a CPU, the engine computes fp32 Linear layers with a "
                                  "copy of their weights packed once for oneDNN, not re-laid out by every matmul "
                                  "(faster steps, a lone stream's too): the replica holds those weights twice; false: "
                                  "one copy")
    forward: Literal["auto", "compiled", "eager"] = Field(
        "auto", description="the model's forward in the engine's steps: compiled (inductor, weights frozen and "
        "packed, the layers one graph, LoRA adapters' rows in it beside base rows; compiled when the replica "
        "starts, never per request), eager (transformers' modules and peft's), or auto: compiled for an fp32 "
        "Llama-laid decoder (Llama, Mistral, Qwen2) on a CPU, where it is measured; eager elsewhere (a GPU, "
        "bf16, other models) until measured there")
    one_token_graph: Literal["auto", "on", "off"] = Field(
        "auto", description="with the forward compiled: a graph of its own for steps of one token without adapters "
        "(a lone stream's decode), its matmuls autotuned when the replica starts between inductor's C++ GEMM "
        "template and ATen's (SmolLM2-135M on 2 cores: a lone stream's step 0.52x the time, its replica ready "
        "half a minute later, holding a copy more of the weights); auto: on where the decoder layers' weights "
        "exceed 64 MiB, beyond a CPU's caches")
    attention_kernel: Literal["auto", "kernel", "torch"] = Field(
        "auto", description="the decode tokens' attention over the cache: kernel (the engine's C++ kernel, built "
        "once per machine with the C++ compiler torch.compile uses: each row read to its own length, once; "
        "SmolLM2-135M's shape at 32 rows on 2 cores: a step's attention in 0.45x the time of torch's operators, "
        "docs/BENCHMARKS.md), torch (torch's batched matmuls and softmax, every row read to the longest, masked), "
        "or auto: the kernel for fp32 on a CPU where it builds, else torch's operators (said in the log)")
    max_adapters: int = Field(4, ge=1, description="LoRA adapters (registered versions a request names as its "
                              "model, NAME:VERSION) held at once by a replica (Ray Serve model multiplexing, least "
                              "recently used unloaded)")
    engine: Literal["builtin", "vllm"] = Field(
        "builtin", description="the engine behind the OpenAI routes: builtin (ours: torch and transformers only, one "
        "device) or vllm (vLLM's engine in a Ray actor running the vLLM venv's Python, `make vllm`: tensor and "
        "pipeline parallelism, CUDA graphs, paged attention; the same routes, limits and metrics)")
    vllm_python: str | None = Field(None, description="engine=vllm: the Python of the venv holding vllm and ray "
                                    "(`make vllm` builds .venv-vllm); null: $WORKFLOWS_VLLM_PYTHON, else the "
                                    "checkout's .venv-vllm/bin/python")
    tensor_parallel_size: int = Field(1, ge=1, description="engine=vllm: GPUs each layer is split over")
    pipeline_parallel_size: int = Field(1, ge=1, description="engine=vllm: stages the layers are split into (on "
                                        "GPUs of one node or of several: one Ray placement group per replica)")
    kv_cache_gib: int = Field(1, ge=1, description="engine=vllm on a CPU: the KV cache's memory (whole GiB, vLLM's "
                                "VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="engine=vllm on GPUs: the fraction of each "
                                          "GPU's memory vLLM may use (weights, activations, KV cache)")
    vllm_engine_args: dict[str, Any] = Field(default_factory=dict, description="engine=vllm: vLLM's engine "
                                             "arguments (AsyncEngineArgs fields, e.g. enforce_eager, "
                                             "enable_prefix_caching, enable_lora: false for a whole model without "
                                             "adapters, where vLLM's CPU build then compiles), over the ones these "
                                             "settings give")
    max_lora_rank: int = Field(16, ge=1, description="engine=vllm: the largest LoRA rank an adapter may have, "
                               "above it refused naming this setting (vLLM's default; vLLM pads every adapter to it, "
                               "and its CPU build's LoRA cost grows with it; one of 1, 8, 16, 32, 64, 128, 256, "
                               "320, 512)")

    @model_validator(mode="after")
    def _chunks(self):
        if self.max_prefill_tokens < self.prefill_chunk:
            raise ValueError(f"max_prefill_tokens ({self.max_prefill_tokens}) is below prefill_chunk "
                             f"({self.prefill_chunk})")
        if self.engine != "vllm" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size need engine: vllm (the builtin engine "
                             "runs on one device)")
        if self.max_lora_rank not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
            raise ValueError(f"max_lora_rank {self.max_lora_rank}: vLLM takes 1, 8, 16, 32, 64, 128, 256, 320 or 512")
        return self


class ServeConfig(Strict):
    enabled: bool = True
    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 exposes the server beyond this machine")
    port: int = Field(8000, ge=1, le=65535)
    num_replicas: int = Field(1, ge=1, description="fixed replica count (when autoscaling is not set)")
    autoscaling: AutoscalingConfig | None = None
    cpus_per_replica: float = Field(1, gt=0)
    gpus_per_replica: float = Field(0, ge=0)
    replica_niceness: int | None = Field(
        0, ge=0, le=19, description="the replicas' CPU niceness: 0, as a server's process; Ray starts its workers at "
        "15 (below its own processes), where a client or a batch job on the same node outruns them; null keeps Ray's"
    )
    control_plane_niceness: int | None = Field(
        19, ge=0, le=19, description="the CPU niceness `workflows serve` gives the processes of its own local "
        "cluster that serve nothing (GCS, dashboard, agents, monitors, Serve's controller, proxy and drain actors) "
        "once its applications are up, so that they do not preempt the replicas; the raylet and the ingress keep "
        "theirs, and a cluster it joined is left alone; null leaves them as Ray starts them"
    )
    precision: Literal["fp32", "bf16", "int8"] = Field(
        "fp32", description="fp32; bf16 (GPU replicas, and CPUs with AVX512-BF16 or AMX); int8 dynamic quantization "
        "of Linear layers (CPU, classifiers)"
    )
    auth_token_env: str | None = Field(
        None, description="name of an environment variable holding a bearer token that every route but /healthz "
        "requires (/openapi.json and /docs too)"
    )
    allow_open: bool = Field(
        False, description="serve on a serve.host beyond loopback with no serve.auth_token_env: an API that anyone "
        "who reaches the port may call. Off, such a start is refused"
    )
    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(
        0.0,
        ge=0,
        description="how long a batch waits to fill once its first instance arrived; 0 batches what queued "
        "up while the model ran (no idle wait)",
    )
    model_in_thread: bool = Field(
        False,
        description="run the model in a thread of the replica, so that its event loop keeps reading and "
        "queueing requests while a batch runs; measured slower on 1-CPU replicas (the threads contend for the "
        "CPU and the GIL: docs/BENCHMARKS.md), hence off; for replicas with more cores or a GPU",
    )
    haproxy: bool | Literal["auto"] = Field(
        "auto",
        description="front the replicas with Ray Serve's HAProxy ingress instead of its Python proxy, on a "
        "cluster the command starts (a running cluster needs RAY_SERVE_ENABLE_HA_PROXY=1 in its environment): "
        "auto where the binary is installed (ray[serve] brings it on Linux), true to insist, false for the "
        "Python proxy; HAProxy measured as fast as a plain FastAPI server in docs/BENCHMARKS.md",
    )
    access_log: bool = Field(
        True,
        description="log a line per request in the proxy and the replica (Ray Serve's access log, in "
        "/tmp/ray/session_latest/logs/serve/); turning it off saved no measurable time (docs/BENCHMARKS.md)",
    )
    max_instances: int = Field(256, ge=1, description="largest `instances` list one request may carry")
    max_request_pixels: int = Field(
        100_000_000, ge=1,
        description="image models: the most pixels one request's images may declare in all (read from their "
        "headers, before any is decoded; each image also stays under preprocess.max_image_pixels): bounds the "
        "decoding one request costs, about 0.75 s for 100 Mpx of PNG on one core; a request over it is a 422",
    )
    demo_requests: int = Field(3, ge=0, description="requests the pipeline sends after deploying")
    alias_poll_s: float = Field(
        2.0, gt=0, description="how often `serve --model NAME@ALIAS` reads the alias, rolling the application over "
        "to the version it moved to; and how long a replica keeps a request's NAME@ALIAS adapter resolved (or "
        "unknown: a 404 without a registry read each time)")
    generate: GenerateConfig = GenerateConfig()


    @model_validator(mode="after")
    def _vllm_gpus(self):
        gen = self.generate
        spans = gen.tensor_parallel_size * gen.pipeline_parallel_size
        if gen.engine == "vllm" and self.gpus_per_replica and self.gpus_per_replica != spans:
            raise ValueError(f"gpus_per_replica ({self.gpus_per_replica}) with generate.engine: vllm is the GPUs one "
                             f"replica's vLLM spans: tensor_parallel_size x pipeline_parallel_size ({spans})")
        if spans > 1 and not self.gpus_per_replica:
            raise ValueError("generate.tensor_parallel_size and pipeline_parallel_size split a model over GPUs: set "
                             "gpus_per_replica to their product")
        return self
