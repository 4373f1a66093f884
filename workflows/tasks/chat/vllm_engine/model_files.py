"""The files vLLM reads, made from what the registry's checks passed: the base model's folder as vLLM takes
it, and each LoRA adapter rewritten from its checked config and weights.

vLLM reads a model folder and an adapter folder itself, so it would act on whatever a bucket put in them:
an adapter's `adapter_config.json` keys beyond LoRA's (peft's modules_to_save, a megatron module to
import) or a pickled `adapter_model.bin` fallback. The replica hands it a folder holding only the rebuilt
config (workflows.tasks.chat.adapters: the allow-list) and the checked safetensors matrices.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from workflows.errors import UserError
from workflows.tasks.chat.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, adapter_weights


def vllm_folder(model_dir: str | Path, out: str | Path) -> Path:
    """The model folder as vLLM reads it: its files linked, its config.json without the `quantization_config`
    a GGUF conversion leaves in it (the packaged base's weights are fp32; vLLM would look for GGUF weights)."""
    model_dir, out = Path(model_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        target = out / f.name
        if f.name != "config.json":
            target.unlink(missing_ok=True)  # a link of an earlier folder
            target.symlink_to(f.absolute())
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(out / "config.json")
    return out


def checked_adapter(model_dir: str, parent: str, max_rank: int) -> str:
    """A folder under `parent` holding the adapter in `model_dir` as the checks read it (its config rebuilt
    from the allow-list, its weights the rank-checked safetensors matrices): the one vLLM loads. A rank above
    `max_rank` (the engine's buffers') is refused naming the setting."""
    from safetensors.torch import save_file

    config = adapter_config(model_dir)  # UserError naming the key, before anything is written
    if config.r > max_rank:
        raise UserError(f"{ADAPTER_CONFIG}: r: {config.r} is above this server's serve.generate.max_lora_rank "
                        f"({max_rank})")
    weights = adapter_weights(model_dir, config.r)
    out = tempfile.mkdtemp(prefix="adapter-", dir=parent)
    try:
        doc = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.r, "lora_alpha": config.lora_alpha,
               "lora_dropout": config.lora_dropout, "target_modules": sorted(config.target_modules),
               "bias": "none"}
        Path(out, ADAPTER_CONFIG).write_text(json.dumps(doc))
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, ADAPTER_WEIGHTS))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out
