"""One forward of a step's tokens. Every token of the step is a batch row of its own, input_ids
[tokens, 1], with its own position id (so rotary embeddings are the row's own), and, for a peft model,
its request's adapter name (`adapter_names` per token: peft mixes adapters across the batch dimension). The model's
attention is the slot attention of workflows.tasks.chat.engine.cache, which writes each token's keys
and values into its request's slot and attends over that slot alone. So a step is one forward: the
weights are read once for the decode tokens and the prefill chunks together, no row is padded to
another's length, and mixed adapters work as in any peft batch. `logits_to_keep` (a boolean per
token) keeps the output head to the tokens whose next token is needed.

A step runs the compiled forward where the engine has one (workflows.tasks.chat.engine.compiled): the
same attention and cache, the layers one graph, LoRA adapters' rows beside base rows in it
(workflows.tasks.chat.engine.lora).
"""

from __future__ import annotations

from typing import Any

import torch

from workflows.tasks.chat.engine.cache import StepPlan, check_plan_used
from workflows.tasks.chat.engine.compiled import CompiledForward
from workflows.tasks.chat.engine.scheduler import StepTokens


def step_logits(model, device: torch.device, step: StepTokens, plan: StepPlan, base: str,
                compiled: CompiledForward | None = None) -> tuple[torch.Tensor, bool]:
    """Logits [tokens kept, vocab] of the step's tokens, in one forward; and whether it ran compiled (a
    compiled engine's step with an adapter the graph cannot compute, or one that would recompile, runs
    eagerly)."""
    keep = torch.tensor(step.keep, device=device)
    if compiled is not None and compiled.current():
        adapted = step.adapted(base)  # rows with LoRA adapters: their deltas in the graph
        adapters = compiled.adapters.step(model, compiled.decoder, step.adapters, base) if adapted else None
        if adapters is not None or not adapted:  # (None when adapted: one the graph cannot compute)
            logits = compiled.logits(torch.tensor(step.ids, device=device),
                                     torch.tensor(step.positions, device=device), plan, keep, adapters)
            if logits is not None:
                check_plan_used(plan)
                return logits, True
    kwargs: dict[str, Any] = {}
    if getattr(model, "peft_config", None):  # a peft model: each token's adapter (or none)
        kwargs["adapter_names"] = step.adapters
    out = model(input_ids=torch.tensor(step.ids, device=device)[:, None],
                position_ids=torch.tensor(step.positions, device=device)[:, None], use_cache=False,
                logits_to_keep=keep[:, None], slot_plan=plan, **kwargs)
    check_plan_used(plan)
    logits = out.logits
    if logits.dim() == 3:  # a model that slices its logits itself: [tokens, 1, vocab]
        logits = logits[:, -1][keep]
    return logits, False
