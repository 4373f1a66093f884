"""Starting the vLLM engine of a replica: its worker actor in the vLLM venv's Python, placed beside the
replica (or over a placement group of GPUs for tensor and pipeline parallelism), vLLM's engine built for
the registered model and, for a registered adapter, that adapter loaded as the served one.

Why an actor of our own, not Ray Serve LLM's LLMServer: that server speaks vLLM's own OpenAI layer (its
routes, its limits, its errors) and loads adapters from a path by name, past the registry's checks; ours
keeps the product's routes and checks and borrows its placement: CPU bundles explicit on a CPU, one
bundle per GPU otherwise, vLLM's Ray executor inside the group when it spans more than one node's GPUs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from workflows.errors import UserError
from workflows.tasks.chat.adapters import is_adapter
from workflows.tasks.chat.vllm_engine.engine import VllmEngine
from workflows.tasks.chat.vllm_engine.model_files import vllm_folder
from workflows.tasks.chat.vllm_engine.worker import VllmWorker

log = logging.getLogger(__name__)
START_TIMEOUT_S = 900  # vLLM's engine build: weights, its compile on a CPU (minutes on 2 cores), its KV cache


def vllm_python(gen) -> str:
    """The vLLM venv's Python (serve.generate.vllm_python, $WORKFLOWS_VLLM_PYTHON, or the checkout's
    .venv-vllm), which must exist: a clear error naming the setting otherwise."""
    checkout = Path(__file__).resolve().parents[4] / ".venv-vllm" / "bin" / "python"
    path = gen.vllm_python or os.environ.get("WORKFLOWS_VLLM_PYTHON") or str(checkout)
    if not os.path.isfile(path):
        raise UserError(f"serve.generate.engine=vllm: no vLLM Python at {path} (serve.generate.vllm_python); "
                        "`make vllm` builds .venv-vllm")
    return os.path.abspath(path)


def engine_args(gen, precision: str, on_gpu: bool, context: int | None) -> dict:
    """vLLM's AsyncEngineArgs for serve.generate: the same batch, context and adapter limits as the
    builtin engine's (the context at most the model's, `context`); log probabilities of the distribution
    sampled from, as ours are; grammars through llguidance, as ours are."""
    parallel = gen.tensor_parallel_size * gen.pipeline_parallel_size
    args = {"dtype": "bfloat16" if precision == "bf16" else "float32", "max_num_seqs": gen.max_batch,
            "max_model_len": min(gen.max_prompt_tokens + gen.max_tokens, context or 1 << 30), "enable_lora": True,
            "max_loras": gen.max_adapters + 1, "max_lora_rank": gen.max_lora_rank,
            "logprobs_mode": "processed_logprobs", "structured_outputs_config": {"backend": "guidance"},
            "tensor_parallel_size": gen.tensor_parallel_size, "pipeline_parallel_size": gen.pipeline_parallel_size,
            "disable_log_stats": True}
    if on_gpu:
        args["gpu_memory_utilization"] = gen.gpu_memory_utilization
        if parallel > 1:
            args["distributed_executor_backend"] = "ray"  # its workers in the replica's placement group
    return {**args, **gen.vllm_engine_args}


def model_context(folder: Path) -> int | None:
    """The positions the model was trained for (its config's max_position_embeddings), if it says."""
    config = json.loads((folder / "config.json").read_text())
    context = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(context) if context else None


def worker_options(python: str, gen, cpus: float, on_gpu: bool, niceness: int | None = None) -> dict:
    """The worker actor's Ray options: the vLLM venv's Python; on a CPU beside the replica (its CPUs are the
    replica's: it asks for none); on GPUs a placement group of one GPU per rank, its first bundle the
    worker's (vLLM's Ray executor places the other ranks in the same group)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    threads = str(max(int(cpus), 1))
    env = {"OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(gen.kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           **({"RAY_worker_niceness": str(niceness)} if niceness is not None else {})}  # the replica's, not Ray's 15
    options: dict = {"runtime_env": {"py_executable": python, "env_vars": env}, "max_concurrency": 1000}
    parallel = gen.tensor_parallel_size * gen.pipeline_parallel_size
    if on_gpu:
        group = ray.util.placement_group([{"GPU": 1, "CPU": 1}] * parallel, strategy="PACK")
        ray.get(group.ready(), timeout=START_TIMEOUT_S)
        in_group = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        # one GPU: the worker's own; more: vLLM's Ray executor starts a worker per GPU in the group
        options.update(num_cpus=0, num_gpus=1 if parallel == 1 else 0, scheduling_strategy=in_group)
    else:
        options.update(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False))
    return options


def start_vllm_engine(model_dir: str, base_dir: str, gen, precision: str, eos: set[int],
                      cpus: float, on_gpu: bool, niceness: int | None = None) -> VllmEngine:
    """vLLM's engine for the registered model in `model_dir` (a whole model, or an adapter on `base_dir`,
    served as the adapter "default"), started and ready; its folders live in a temporary directory the
    engine removes when it closes."""
    import ray
    from ray import cloudpickle

    python = vllm_python(gen)
    if is_adapter(model_dir) and not gen.vllm_engine_args.get("enable_lora", True):
        raise UserError("serve.generate.vllm_engine_args.enable_lora=false: the served model is a LoRA adapter, which "
                        "vLLM serves with enable_lora only")
    work = tempfile.mkdtemp(prefix="workflows-vllm-")
    try:
        folder = vllm_folder(base_dir, Path(work) / "model")
        cloudpickle.register_pickle_by_value(sys.modules[VllmWorker.__module__])  # that venv has no workflows
        args = engine_args(gen, precision, on_gpu, model_context(folder))
        actor = ray.remote(VllmWorker).options(**worker_options(python, gen, cpus, on_gpu, niceness)).remote(
            str(folder), args, {})
        info = ray.get(actor.ready.remote(), timeout=START_TIMEOUT_S)
        log.info("vLLM %s engine ready: %s (context %d)", info["version"], folder, info["max_model_len"])
        engine = VllmEngine(actor, info, eos, max_batch=gen.max_batch, max_queue=gen.max_queue,
                            retry_after_s=gen.retry_after_s, max_prompt_tokens=gen.max_prompt_tokens,
                            timeout_s=gen.timeout_s, work_dir=work,
                            max_lora_rank=int(args["max_lora_rank"]) if args["enable_lora"] else None)
        if is_adapter(model_dir):  # the registered adapter, served as peft's "default" is by the builtin engine
            engine.add_adapter("default", model_dir).result(timeout=START_TIMEOUT_S)
        return engine
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
