"""The models the generation bench serves (workflows.bench.generate): a registered chat model named by
`model`, or the config's base model registered into a scratch store as `bench-base`, beside a LoRA
adapter of it registered as `bench-lora`, shaped as the chat config trains one (its rank, alpha and
modules), for the adapter rows: requests that name the adapter, alone or in turn with the base, to the
same `workflows serve`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER = "bench-lora"


@dataclass
class Served:
    spec: str  # the version `workflows serve` serves (NAME:VERSION)
    store: list[str]  # the config overrides that reach its store
    model_dir: str  # the served version's local folder
    card: Any
    adapter: str = ""  # the adapter's spec, where one is registered
    adapter_dir: str = ""  # its folder (vLLM loads it from there)


def served_model(cfg, config: str, config_overrides: list[str], opts: dict, scratch: Path,
                 adapter: bool = False) -> Served:
    """What the bench serves; with `adapter`, the base model also gets an adapter (never a model named by
    `model`, which may be an adapter itself)."""
    from workflows import registry
    from workflows.runtime import runtime
    from workflows.tasks.chat.training.model import resolve_dir

    if opts["model"]:
        with runtime(cfg, ray_needed=False) as rt:
            model_dir, card = registry.fetch(rt.cfg, rt.storage, opts["model"])
        return Served(f"{card.name}:{card.version}", [], model_dir, card)
    from workflows.config import load_config
    from workflows.storage.uri import StorageContext

    store = [f"storage.root={scratch / 'store'}", "storage.embedded.enabled=false"]
    local = load_config(config, [*config_overrides, *store])
    ctx = StorageContext.from_config(local.storage)
    base = resolve_dir(cfg.model.name_or_path, cfg)
    ref = registry.register(local, ctx, base, "bench-base", {"task": cfg.model.task})
    model_dir, card = registry.fetch(local, ctx, f"{ref.name}:{ref.version}")
    served = Served(f"{ref.name}:{ref.version}", store, model_dir, card)
    if adapter:
        folder = build_adapter(cfg, base, scratch / ADAPTER)
        lora = registry.register(local, ctx, str(folder), ADAPTER, adapter_card(cfg, base))
        served.adapter, served.adapter_dir = f"{lora.name}:{lora.version}", str(folder)
    return served


def adapter_card(cfg, base_dir: str) -> dict:
    """An adapter's card as the chat task's export writes it: its base by name and by the sha256 of its
    weights (what a replica checks before it takes the adapter)."""
    from workflows.tasks.chat.training.model import weights_sha256

    return {"task": cfg.model.task, "export": "adapter",
            "base": {"name_or_path": cfg.model.name_or_path, "sha256": weights_sha256(base_dir)}}


def build_adapter(cfg, base_dir: str, out: Path) -> Path:
    """A LoRA adapter of the base as the config's chat options make one (model.options.lora_r, lora_alpha,
    lora_target_modules), saved with peft; its weights are random and nonzero (seeded), since what an
    adapter's rows cost does not depend on what it learned, only on its rank and the layers it adapts."""
    import torch

    from workflows.tasks import task_class
    from workflows.tasks.chat.training.model import load_causal_lm, load_tokenizer, with_lora

    torch.manual_seed(0)
    model = with_lora(load_causal_lm(base_dir), task_class(cfg.model.task)(cfg).options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero (the adapter a no-op): give it weight
                p.normal_(0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(base_dir).save_pretrained(out)
    return out
