"""LoRA adapters read from the store: the chat wing's trust checks on files a bucket holds.

A registered adapter version holds peft's `adapter_config.json` and `adapter_model.safetensors`. Neither
is handed to peft as it is: the config is rebuilt from an allow-list of LoRA fields, each in its bounds
(`adapter_config`), and the weights are read from safetensors only, each a LoRA matrix of the config's
rank (`adapter_weights`), never from peft's pickled fallback. `load_adapter` adds one to a model, every
matrix of it loaded or nothing of it left; `remove_adapter` takes one off.

A room of its own, importing no other room of the wing: training loads a registered adapter through it
(evaluation, an adapter merged into a base), and serving loads and unloads a replica's adapters.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from workflows.errors import UserError
from workflows.storage.confine import shown

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
MAX_LORA_RANK = 4096
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
# what an adapter's LoraConfig is rebuilt from: what with_lora sets (bias "none"), nothing else
LORA_FIELDS = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias")
# keys peft writes with a value, which describe and never change the computation
LORA_NOTES = frozenset({"auto_mapping", "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights",
                        "peft_version", "megatron_core", "qalora_group_size"})
_MODULE_NAME = re.compile(r"[A-Za-z0-9_]{1,128}(?:\.[A-Za-z0-9_]{1,128}){0,15}")  # q_proj, model.layers.0.mlp.up_proj
MAX_TARGET_MODULES = 4096
_LORA_KEY = re.compile(r"(?:[A-Za-z0-9_]+\.)+lora_([AB])\.weight")


def is_adapter(model_dir: str) -> bool:
    """Whether a model directory holds a LoRA adapter (its config) rather than a whole model."""
    return os.path.isfile(os.path.join(model_dir, ADAPTER_CONFIG))


def adapter_config(model_dir: str):
    """The adapter's LoraConfig, rebuilt from LORA_FIELDS of its adapter_config.json: the file is the
    bucket's, and peft acts on much else it may hold (a module to import for megatron_config, layers
    replicated or modules_to_save changed in the base shared by every client of the replica). Any
    other key set to a value is refused, as is a field out of its bounds, in one line naming the key."""
    from peft import LoraConfig

    def refuse(key: str, why: str):
        raise UserError(f"{ADAPTER_CONFIG}: {key}: {why}: refused (plain LoRA adapters only: type, rank, alpha, "
                        "dropout, plain-name target modules, bias none)")

    with open(os.path.join(model_dir, ADAPTER_CONFIG), "rb") as f:
        raw = f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
    if len(raw) > MAX_ADAPTER_CONFIG_BYTES:
        refuse("(the file)", f"over {MAX_ADAPTER_CONFIG_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except ValueError:
        refuse("(the file)", "not JSON")
    if not isinstance(doc, dict):
        refuse("(the file)", f"not a JSON object but {type(doc).__name__}")
    for key, value in doc.items():
        if key not in LORA_FIELDS and key not in LORA_NOTES and value not in (None, False, {}, [], ""):
            refuse(key, f"set to {shown(value, 60)}")
    if doc.get("megatron_core") not in (None, "megatron.core"):  # peft's default: a module it may import
        refuse("megatron_core", f"{shown(doc['megatron_core'], 60)}, not peft's 'megatron.core'")
    get = doc.get
    if get("peft_type") != "LORA":
        refuse("peft_type", f"{shown(get('peft_type'), 60)}, not 'LORA'")
    if get("task_type") not in (None, "CAUSAL_LM"):
        refuse("task_type", f"{shown(get('task_type'), 60)}, not 'CAUSAL_LM'")
    r, alpha, dropout = get("r"), get("lora_alpha"), get("lora_dropout", 0.0)
    if type(r) is not int or not 1 <= r <= MAX_LORA_RANK:
        refuse("r", f"{shown(r, 60)}, not a rank from 1 to {MAX_LORA_RANK}")
    if type(alpha) not in (int, float) or not 0 < alpha <= 1e6:
        refuse("lora_alpha", f"{shown(alpha, 60)}, not a number above 0")
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        refuse("lora_dropout", f"{shown(dropout, 60)}, not a number from 0 to below 1")
    targets = get("target_modules")
    if (not isinstance(targets, list) or not 1 <= len(targets) <= 256
            or not all(isinstance(t, str) and _MODULE_NAME.fullmatch(t) for t in targets)):
        refuse("target_modules", f"{shown(targets, 60)}, not a list of module names")
    if get("bias", "none") != "none":
        refuse("bias", f"{shown(get('bias'), 60)}, not 'none'")
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=list(targets), bias="none",
                      task_type=get("task_type"), inference_mode=True)


def adapter_weights(model_dir: str, rank: int) -> dict:
    """The adapter's LoRA weights, from its safetensors file only (never peft's fallback to a pickled
    adapter_model.bin): each a lora_A (rank rows) or lora_B (rank columns) matrix of a named module."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = os.path.join(model_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise UserError(f"{ADAPTER_WEIGHTS}: missing (adapter weights load from safetensors only)")
    try:
        with safe_open(path, "pt") as f:
            for key in f.keys():
                m = _LORA_KEY.fullmatch(key)
                shape = list(f.get_slice(key).get_shape())
                if not m or len(shape) != 2 or shape[0 if m.group(1) == "A" else 1] != rank:
                    raise UserError(f"{ADAPTER_WEIGHTS}: {shown(key, 80)} (shape {shape}) is not a lora_A or lora_B "
                                    f"matrix of rank {rank}: refused")
        return load_file(path)
    except SafetensorError as e:
        raise UserError(f"{ADAPTER_WEIGHTS}: not a safetensors file ({str(e).splitlines()[0][:120]})") from None


def load_adapter(model, model_dir: str, name: str):
    """`model` (a causal LM, or one peft wraps already) with the adapter in `model_dir` added as `name`,
    built from `adapter_config` and filled from `adapter_weights`, every LoRA matrix of it loaded;
    frozen. On any failure nothing of it stays: the adapter is deleted, a model wrapped for it unwrapped."""
    from peft import PeftModel, get_peft_model
    from peft.utils import set_peft_model_state_dict

    config = adapter_config(model_dir)
    weights = adapter_weights(model_dir, config.r)
    fresh = not isinstance(model, PeftModel)
    if fresh:
        model = get_peft_model(model, config, adapter_name=name)
    else:
        model.add_adapter(name, config)
    try:
        loaded: Any = set_peft_model_state_dict(model, weights, adapter_name=name)  # missing and unexpected keys
        missing = [k for k in loaded.missing_keys if f".{name}." in k and ".lora_" in k]
        if loaded.unexpected_keys or missing:
            what = loaded.unexpected_keys[:1] or missing[:1]
            raise UserError(f"{ADAPTER_WEIGHTS}: {len(loaded.unexpected_keys)} matrices for no module of the model "
                            f"and {len(missing)} of its modules without one (first: {shown(what[0], 80)}): refused")
        for n, p in model.named_parameters():
            if f".{name}." in n:
                p.requires_grad_(False)
    except BaseException:
        remove_adapter(model, name, unwrap=fresh)
        raise
    return model


def remove_adapter(model, name: str, unwrap: bool):
    """`model` (a peft model) without adapter `name`: where `unwrap` and it was the last adapter, the
    base model, its own layers back in place; else the adapter deleted and, where it was the active
    one, another made active (peft keeps a deleted name active, and every later forward fails)."""
    if unwrap and set(model.peft_config) == {name}:
        return model.unload().eval()
    model.delete_adapter(name)
    if model.active_adapter not in model.peft_config:
        model.set_adapter(next(iter(model.peft_config)))
    return model
