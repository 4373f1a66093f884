"""The chat task's model: the pretrained causal LM it starts from, LoRA or full fine-tuning, greedy
decoding, the registered artifact (a LoRA adapter, or a whole model), and a registered one loaded back
(an adapter through workflows.tasks.chat.adapters' checks).

`model.name_or_path` names the base model:
- `smollm2`: SmolLM2-135M-Instruct, packaged (`smollm2` converts it once per node);
- a local directory or an object-store URI in from_pretrained layout (safetensors weights, tokenizer
  with a chat template), read through the node's model cache (workflows.storage.model_dir);
- `registry:NAME[:VERSION]`, a registered chat model: a whole model is used as it is; an adapter is
  applied to its own base (which its card names, checked by sha256) and merged.

The base is identified by the sha256 of its weight files (`weights_sha256`): a card of an adapter
names its base and that hash, and a base whose weights differ is refused (`card_base_dir`; serving's
checks of an adapter against the base it serves).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from workflows.errors import UserError
from workflows.model_card import ModelCard, write_card
from workflows.storage.model_cache import cached_dir
from workflows.storage.model_dir import fetch_model_dir
from workflows.tasks.chat.adapters import is_adapter, load_adapter
from workflows.tasks.chat.training.smollm2 import NAME, smollm2_dir

REGISTRY_PREFIX = "registry:"


def attn_implementation() -> str:
    """SDPA on GPU (flash / memory-efficient kernels); eager on CPU, bit-stable (as the causal LM)."""
    import torch

    return "sdpa" if torch.cuda.is_available() else "eager"


def resolve_dir(name_or_path: str, cfg, whole: bool = False) -> str:
    """A local directory holding `name_or_path` (see the module docstring) on this node; `whole`: a
    registered model must be a whole model (an adapter's base: no chain of adapters)."""
    if name_or_path == NAME:
        return smollm2_dir(cfg.cache.resolved_dir())
    if name_or_path.startswith(REGISTRY_PREFIX):
        return registered_dir(name_or_path, cfg, whole)
    return fetch_model_dir(name_or_path, cfg)


def registered_dir(name_or_path: str, cfg, whole: bool = False) -> str:
    """A registered chat model as a from_pretrained directory: its own folder when it holds a whole
    model; an adapter merged into its base, once per node, into the model cache."""
    from workflows import registry
    from workflows.storage.uri import StorageContext

    spec = name_or_path.removeprefix(REGISTRY_PREFIX)
    model_dir, card = registry.fetch(cfg, StorageContext.from_config(cfg.storage), spec)
    if card.task != "chat":
        raise UserError(f"model.name_or_path {name_or_path!r}: a {card.task} model, not a chat model")
    if not is_adapter(model_dir):
        return model_dir
    if whole:
        raise UserError(f"base model {name_or_path!r} is itself an adapter: an adapter's base must be a whole model")

    def merge(directory: str) -> None:
        model = load_trained(model_dir, card, cfg).merge_and_unload()
        model.save_pretrained(directory, safe_serialization=True)
        load_tokenizer(model_dir).save_pretrained(directory)

    return cached_dir(os.path.join(cfg.cache.resolved_dir(), "models"), f"merged-{card.artifact_id}", merge)


def weights_sha256(model_dir: str) -> str:
    """sha256 over the directory's weight files (*.safetensors, by name): the base model's identity."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no safetensors weights")
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode())
        with open(os.path.join(model_dir, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def load_tokenizer(model_dir: str):
    """The model's tokenizer; it must have a chat template and an eos token (which ends a turn)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tok, "chat_template", None):
        raise UserError(f"{model_dir}: the tokenizer has no chat template")
    if tok.eos_token_id is None:
        raise UserError(f"{model_dir}: the tokenizer has no eos token")
    return tok


def pad_id(tok) -> int:
    """The id padding is written with: the tokenizer's pad token, else its eos (padding is masked by
    the attention mask and -100 labels, never recognized by its id)."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def load_causal_lm(model_dir: str, dropout: float | None = None):
    """A pretrained causal LM in fp32 (safetensors weights only); `dropout`: model.dropout, if set."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if dropout is not None and hasattr(config, "attention_dropout"):
        config.attention_dropout = dropout
    config.use_cache = False  # training; greedy_generate asks for the cache itself
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32, use_safetensors=True,
                                                attn_implementation=attn_implementation())


def with_lora(model, options):
    """The model wrapped by peft with new LoRA adapters (seeded by the caller); the base frozen."""
    from peft import LoraConfig, get_peft_model

    targets: Any = options.lora_target_modules
    config = LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                        target_modules="all-linear" if targets == "all-linear" else list(targets),
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def frozen_linears_to(model, dtype) -> int:
    """The frozen base's Linear layers stored in `dtype` (bf16), LoRA's adapters left in fp32; returns how
    many layers changed. Under bf16 autocast a matmul over an fp32 weight casts it anew every forward
    (hundreds of casts a step for SmolLM2's 210 linear layers, and a bf16 copy of each held for the
    backward); stored in bf16, the weight is read as it is. Only Linear layers whose weights no other
    module shares (a tied output head is the input embedding, which autocast leaves in fp32): autocast
    would round exactly these weights to bf16 for their matmuls, so training computes the same numbers."""
    import torch.nn as nn

    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    changed = 0
    for m in model.modules():
        frozen = [p for p in m.parameters(recurse=False) if not p.requires_grad]
        if isinstance(m, nn.Linear) and frozen and len(frozen) == len(list(m.parameters(recurse=False))) \
                and not any(id(p) in shared for p in frozen):
            m.to(dtype)
            changed += 1
    return changed


def greedy_generate(model, prompt_ids, prompt_mask, max_new_tokens: int, eos_id: int, pad: int, sync: bool = False):
    """Greedy continuations of left-padded prompts: [rows, <= max_new_tokens] token ids, `pad` after
    a row's eos. Every step calls the model's own forward (the FSDP2 root's, whose hooks gather its
    parameters), with a KV cache. `sync`: the ranks of a process group step together until every
    rank's rows have ended (FSDP2 gathers parameters in each forward), as transformers' synced_gpus."""
    import torch
    import torch.distributed as dist

    rows = prompt_ids.shape[0]
    mask = prompt_mask.clone()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, last = out.past_key_values, positions[:, -1:]
    done = torch.zeros(rows, dtype=torch.bool, device=prompt_ids.device)
    tokens = []
    for step in range(max_new_tokens):
        nxt = out.logits[:, -1, :].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        tokens.append(nxt)
        done |= nxt == eos_id
        unfinished = torch.tensor([0.0 if bool(done.all()) else 1.0])
        if sync:
            dist.all_reduce(unfinished, op=dist.ReduceOp.MAX)
        if step == max_new_tokens - 1 or not unfinished.item():
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        last = last + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last, past_key_values=cache,
                    use_cache=True)
        cache = out.past_key_values
    return torch.stack(tokens, dim=1) if tokens else torch.zeros(rows, 0, dtype=torch.long)


def completion_text(tok, ids, eos_id: int) -> str:
    """A generated row's text: the tokens before its first eos, decoded, stripped."""
    ids = [int(i) for i in ids]
    if eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    return tok.decode(ids, skip_special_tokens=True).strip()


# --- the registered artifact -----------------------------------------------------------------------
def export_chat(task, state: dict, data, out_dir: str, lineage: dict) -> dict:
    """The trained weights as the registry's artifact, and its card. LoRA with options.export=adapter:
    the adapter (adapter_config.json, adapter_model.safetensors) and the card naming its base and
    the base's weights sha256; merged: the adapter merged into the base, a whole model (config.json,
    model.safetensors); full fine-tuning: the whole model. The tokenizer (with its chat template)
    goes with each."""
    cfg, options = task.cfg, task.options
    base_dir = resolve_dir(cfg.model.name_or_path, cfg)
    model = task.build_model(data)
    model.load_state_dict(state, strict=True)
    kind = "full" if options.finetune == "full" else options.export
    if kind == "merged":
        model = model.merge_and_unload()
    model.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(base_dir).save_pretrained(out_dir)
    card = ModelCard(task=cfg.model.task, label_column=data.label_column, max_length=data.max_length,
                     lineage=lineage, info=data.info, options=options.model_dump(mode="json"), export=kind,
                     base={"name_or_path": cfg.model.name_or_path, "sha256": weights_sha256(base_dir)})
    return write_card(card, out_dir)


def card_base_dir(card, cfg) -> str:
    """The base model an adapter's card names, on this node, checked against the card's sha256.
    The card comes from the store, so the name it holds chooses what is read only where it is
    one this config could name too: the packaged model, a registered model, an object-store URI
    under storage.root, or the config's own model.name_or_path."""
    base = dict(getattr(card, "base", None) or {})
    name, sha = str(base.get("name_or_path") or ""), str(base.get("sha256") or "")
    root = cfg.storage.root.rstrip("/") + "/"
    under_root = name.startswith(root) and ".." not in name[len(root):].replace("\\", "/").split("/")
    if not (name == NAME or name.startswith(REGISTRY_PREFIX) or name == cfg.model.name_or_path or under_root):
        raise UserError(f"model {card.name}:v{card.version} is an adapter of {name!r}, which this command does not "
                        f"read: set model.name_or_path={name} to use that base")
    directory = resolve_dir(name, cfg, whole=True)
    if (found := weights_sha256(directory)) != sha:
        raise UserError(f"base model {name!r} has weights sha256 {found[:16]}..., the adapter "
                        f"{card.name}:v{card.version} was trained on {sha[:16]}...: not the same base")
    return directory


def load_trained(model_dir: str, card, cfg):
    """A registered chat model in eval mode: a whole model, or an adapter on its checked base (kept
    unmerged, so that `disable_adapter` gives the base model back)."""
    if not is_adapter(model_dir):
        return load_causal_lm(model_dir).eval()
    base = load_causal_lm(card_base_dir(card, cfg))
    try:
        return load_adapter(base, model_dir, "default").eval()
    except UserError as e:
        raise UserError(f"model {card.name}:v{card.version}: {e}") from None
