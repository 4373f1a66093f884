"""LoRA adapters in the compiled forward: each row's adapter, in the same graph as the base rows.

peft's mixed-adapter forward picks each adapter's rows in Python at every projection, which a compiled
graph cannot hold (the rows change every step). Here the adapters' matrices are the graph's opaque
`workflows_chat::lora_delta` op, as the slot attention is: for a layer's projection group (q, k and v
together; o; gate and up together; down) it returns what the step's adapters add to the group's output,
row by row (zeros for base rows), from the step's `AdapterStep` (which adapter's rows are which), set by
the step that runs it. What it computes is peft's vanilla LoRA, B(A(x)) x scaling (+ B's bias): an
adapter peft computes otherwise (DoRA and other variants), or one on modules the compiled forward does
not know (the embedding, the head), is not `compilable` and its rows run the eager forward.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workflows.tasks.chat.engine.device import model_device

GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
current = threading.local()  # `lora`: the AdapterStep of the step running in this thread


@dataclass
class AdapterStep:
    """The adapters of a step's rows: (token indices, or None for every token; the adapter's table)."""

    adapters: list[tuple[torch.Tensor | None, list]] = field(default_factory=list)


@torch.library.custom_op("workflows_chat::lora_delta", mutates_args=())
def lora_delta(x: torch.Tensor, layer: int, group: int, width: int) -> torch.Tensor:
    """x [tokens, in] -> [tokens, width]: what the step's adapters add to layer `layer`'s projection group
    `group` (GROUPS), each adapter to its own rows."""
    out = x.new_zeros(x.shape[0], width)
    for rows, table in current.lora.adapters:
        parts = table[layer][group]
        if not parts:
            continue
        xs = x if rows is None else x.index_select(0, rows)
        for offset, a, b, bias, scale in parts:
            delta = F.linear(F.linear(xs, a), b, bias) * scale
            if rows is None:
                out[:, offset:offset + delta.shape[1]] += delta
            else:
                out[:, offset:offset + delta.shape[1]].index_add_(0, rows, delta)
    return out


@lora_delta.register_fake
def _(x, layer, group, width):
    return x.new_empty(x.shape[0], width)


def adapter_table(model, name: str) -> list | None:
    """Per layer, per projection group, the adapter `name`'s matrices: (offset in the group's output, A, B,
    B's bias, scaling) for each projection it adapts; None where the compiled forward cannot compute it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    table, found = [], 0
    for layer in base.model.layers:
        groups = []
        for projections in GROUPS:
            parts, offset = [], 0
            for proj in projections:
                module = getattr(layer.self_attn if proj[0] in "qkvo" else layer.mlp, proj)
                width = getattr(module, "base_layer", module).weight.shape[0]
                lora_a = getattr(module, "lora_A", {})
                if name in lora_a:
                    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name):
                        return None  # DoRA or another variant: peft's own forward
                    b = module.lora_B[name]
                    parts.append((offset, lora_a[name].weight.detach(), b.weight.detach(),
                                  None if b.bias is None else b.bias.detach(), float(module.scaling[name])))
                    found += 1
                offset += width
            groups.append(parts)
        table.append(groups)
    adapted = sum(1 for m in model.modules() if name in (getattr(m, "lora_A", None) or {}))
    return table if adapted == found else None  # an adapted module outside the seven projections: eager


class Adapters:
    """The tables of the adapters a model holds, made on first use and made again when the adapter is
    loaded again (its config object replaced)."""

    def __init__(self):
        self._tables: dict[str, tuple[object, list | None]] = {}

    def step(self, model, adapters: list[str], base: str) -> AdapterStep | None:
        """The AdapterStep of a step whose tokens have these adapters (`base` for none); None where one of
        them is not compilable."""
        names = sorted(set(adapters) - {base})
        step = AdapterStep()
        configs = getattr(model, "peft_config", None) or {}
        for gone in set(self._tables) - set(configs):  # an unloaded adapter's matrices are not kept alive here
            del self._tables[gone]
        for name in names:
            config = configs.get(name)
            held = self._tables.get(name)
            if held is None or held[0] is not config:
                held = self._tables[name] = (config, adapter_table(model, name) if config is not None else None)
            if held[1] is None:
                return None
            rows = None if len(names) == 1 and base not in adapters else torch.tensor(
                [i for i, a in enumerate(adapters) if a == name], device=model_device(model))
            step.adapters.append((rows, held[1]))
        return step

