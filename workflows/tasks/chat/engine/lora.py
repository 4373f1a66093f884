"""LoRA adapters in the compiled forward: each row's adapter, in the same graph as the base rows.

peft's mixed-adapter forward picks each adapter's rows in Python at every projection, which a compiled
graph cannot hold (the rows change every step). Here a step's adapters are inputs of the graph, the way
multi-adapter servers batch them (Punica, S-LoRA): for each of a layer's projection groups (q, k and v
together; o; gate and up together; down) the A matrices of the step's adapters stacked by rows, each
adapter a block of columns of their product with the group's input, which a per-token mask scales by the
adapter's scaling (zero outside the token's adapter: base tokens get zeros), then one matmul by the B
matrices (block-diagonal over the group's projections). B's bias rides in that matmul: a column of ones per
adapter after the blocks, which the mask keeps for the token's own adapter alone, and B's bias (times the
scaling) as those columns of B (as many as the mask rows, padded to RANK_ALIGN), so no layer gathers a
bias per token. So an adapted projection is two small matmuls and elementwise work the compiler fuses, and
the inputs of a set of adapters are made once (`Adapters`), not per step.

What it computes is peft's vanilla LoRA, B(A(x)) x scaling (+ B's bias): an adapter peft computes
otherwise (DoRA and other variants), or one on modules the compiled forward does not know (the
embedding, the head), is not `compilable` and its rows run the eager forward.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workflows.tasks.chat.engine.device import model_device

GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
# each adapter's columns in a group: its rank rounded up to this (so that no column count is 0 or 1, which the
# compiler would specialize a graph on, and the blocks stay aligned for vector loads)
RANK_ALIGN = 8
# a group's columns at least this many, zeros beyond its adapters': more than 16, so the graph never guards on
# inductor's choice for a [1, k] x [k, n] matmul (with k <= 16 it computes one elementwise)
MIN_COLUMNS = 24
SETS_KEPT = 4  # the stacked inputs of this many sets of adapters are kept (a step's set is mostly the last one's)


@dataclass
class AdapterStep:
    """A step's adapters, as the compiled graph takes them: per projection group, `a` [layers, columns, in],
    `b` [layers, out, columns + bias columns] (the bias columns: B's bias times the scaling, one per adapter,
    zeros for base tokens and beyond, adapters + 1 padded to RANK_ALIGN) and `masks` [adapters + 1, columns +
    bias columns] (each adapter's scaling at its own columns and a one at its bias column; the last row base
    tokens': zeros but that one); `rows` [tokens]: each token's adapter, its row of `masks`."""

    a: tuple[torch.Tensor, ...]
    b: tuple[torch.Tensor, ...]
    masks: tuple[torch.Tensor, ...]
    rows: torch.Tensor

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return (*self.a, *self.b, *self.masks, self.rows)


def delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What a layer's adapters add to a projection group's output: x [tokens, in], `a` [columns, in], `b` [out,
    columns + bias columns] and `mask` [tokens, columns + bias columns], the tokens' rows of a step's masks."""
    h = F.linear(x, a)
    ones = h.new_ones(h.shape[0], mask.shape[1] - h.shape[1])  # the bias columns: the mask keeps the token's own
    return F.linear(torch.cat([h, ones], 1) * mask, b)


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


def group_shapes(decoder) -> list[tuple[int, list[int]]]:
    """Per projection group, its input width and its projections' output widths, from the compiled decoder."""
    p = decoder._p  # its weights are named as the projections, without "_proj"
    names = [[proj.removesuffix("_proj") for proj in group] for group in GROUPS]
    return [(p(0, group[0]).shape[1], [p(0, n).shape[0] for n in group]) for group in names]


def stacked(tables: list[list], shapes: list[tuple[int, list[int]]], layers: int, device, dtype) -> AdapterStep:
    """The graph's inputs for a set of adapters (their `adapter_table`s, in the order of their mask rows), `rows`
    left empty: per group, every adapter's A and B at its own block of columns, for each of the group's
    projections, zeros where it does not adapt that projection in a layer."""
    a_s, b_s, masks = [], [], []
    sets = len(tables) + 1  # a mask row per adapter and one for base tokens, and as many bias columns
    width = -(-sets // RANK_ALIGN) * RANK_ALIGN  # the bias columns, aligned as the blocks (zeros beyond `sets`)
    for g, (width_in, widths) in enumerate(shapes):
        ranks = [max([a.shape[0] for layer in t for _, a, *_ in layer[g]] or [0]) for t in tables]
        blocks = [-(-max(r, 1) // RANK_ALIGN) * RANK_ALIGN for r in ranks]
        columns = max(sum(blocks) * len(widths), MIN_COLUMNS)
        a = torch.zeros(layers, columns, width_in, device=device, dtype=dtype)
        b = torch.zeros(layers, sum(widths), columns + width, device=device, dtype=dtype)
        mask = torch.zeros(sets, columns + width, device=device, dtype=dtype)
        mask[:, columns:columns + sets] = torch.eye(sets, device=device, dtype=dtype)
        starts = [sum(widths[:k]) for k in range(len(widths))]
        for j, table in enumerate(tables):
            for i, layer in enumerate(table):
                for offset, la, lb, lbias, scale in layer[g]:
                    k = starts.index(offset)  # which projection of the group
                    col = k * sum(blocks) + sum(blocks[:j])
                    r = la.shape[0]
                    a[i, col:col + r] = la
                    b[i, offset:offset + lb.shape[0], col:col + r] = lb
                    mask[j, col:col + r] = scale
                    if lbias is not None:
                        b[i, offset:offset + lb.shape[0], columns + j] = lbias * scale
        a_s.append(a)
        b_s.append(b)
        masks.append(mask)
    return AdapterStep(tuple(a_s), tuple(b_s), tuple(masks), torch.zeros(0, dtype=torch.long))


class Adapters:
    """The tables of the adapters a model holds, made on first use and made again when the adapter is
    loaded again (its config object replaced), and the graph's inputs of the last few sets of them."""

    def __init__(self) -> None:
        self._tables: dict[str, tuple[object, list | None, int]] = {}  # name: (config, table, when made)
        self._sets: OrderedDict[tuple, AdapterStep] = OrderedDict()  # ((name, when made), ...): inputs
        self._made = itertools.count()

    def step(self, model, decoder, adapters: list[str], base: str) -> AdapterStep | None:
        """The AdapterStep of a step whose tokens have these adapters (`base` for none); None where one of
        them is not compilable."""
        names = sorted(set(adapters) - {base})
        configs = getattr(model, "peft_config", None) or {}
        for gone in set(self._tables) - set(configs):  # an unloaded adapter's matrices are not kept alive here
            del self._tables[gone]
        for name in names:
            config = configs.get(name)
            held = self._tables.get(name)
            if held is None or held[0] is not config:
                table = adapter_table(model, name) if config is not None else None
                held = self._tables[name] = (config, table, next(self._made))
            if held[1] is None:
                return None
        made = {(name, held[2]) for name, held in self._tables.items()}
        for old in [k for k in self._sets if not made.issuperset(k)]:  # a set with an adapter unloaded or replaced
            del self._sets[old]
        with torch.inference_mode():  # as the warm-up's inputs were made (inference tensors: a guard)
            return self._step(model, decoder, names, adapters)

    def _step(self, model, decoder, names: list[str], adapters: list[str]) -> AdapterStep:
        key = tuple((name, self._tables[name][2]) for name in names)
        found = self._sets.pop(key, None)
        if found is None:
            tables = [t for t in (self._tables[name][1] for name in names) if t is not None]
            found = stacked(tables, group_shapes(decoder), len(tables[0]), model_device(model), decoder.embed.dtype)
        self._sets[key] = found
        for old in list(self._sets)[:-SETS_KEPT]:
            del self._sets[old]
        index = {name: j for j, name in enumerate(names)}
        rows = torch.tensor([index.get(a, len(names)) for a in adapters], device=model_device(model))
        return AdapterStep(found.a, found.b, found.masks, rows)


def warm_up_step(decoder, tokens: int) -> AdapterStep:
    """Inputs of the graph's shapes for a compile (zeros): two adapters, columns of other counts per group."""
    shapes, layers = group_shapes(decoder), len(decoder.layers_)
    device, dtype = decoder.embed.device, decoder.embed.dtype
    # per group; a mask row per adapter and for base tokens, their bias columns aligned (other counts than the blocks)
    columns, sets, width = (48, 40, 32, 24), 3, 16
    return AdapterStep(
        tuple(torch.zeros(layers, c, w_in, device=device, dtype=dtype) for c, (w_in, _) in zip(columns, shapes)),
        tuple(torch.zeros(layers, sum(w), c + width, device=device, dtype=dtype) for c, (_, w) in zip(columns, shapes)),
        tuple(torch.zeros(sets, c + width, device=device, dtype=dtype) for c in columns),
        torch.zeros(tokens, dtype=torch.long, device=device))
