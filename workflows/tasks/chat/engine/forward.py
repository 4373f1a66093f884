"""One forward of a step's tokens: every token a batch row of its own (input_ids [tokens, 1]) with its own
position id and, for a peft model, its request's adapter name; the slot attention reads and writes the
cache by the step's plan (workflows.tasks.chat.engine.cache); `logits_to_keep` keeps the output head to
the tokens whose next token is needed. See workflows.tasks.chat.engine.loop.
"""

from __future__ import annotations

from typing import Any

import torch

from workflows.tasks.chat.engine.cache import StepPlan, check_plan_used
from workflows.tasks.chat.engine.scheduler import StepTokens


def step_logits(model, device: torch.device, step: StepTokens, plan: StepPlan) -> torch.Tensor:
    """Logits [tokens kept, vocab] of the step's tokens, in one forward."""
    keep = torch.tensor(step.keep, device=device)[:, None]
    kwargs: dict[str, Any] = {}
    if getattr(model, "peft_config", None):  # a peft model: each token's adapter (or none)
        kwargs["adapter_names"] = step.adapters
    out = model(input_ids=torch.tensor(step.ids, device=device)[:, None],
                position_ids=torch.tensor(step.positions, device=device)[:, None], use_cache=False,
                logits_to_keep=keep, slot_plan=plan, **kwargs)
    check_plan_used(plan)
    logits = out.logits
    if logits.dim() == 3:  # a model that slices its logits itself: [tokens, 1, vocab]
        logits = logits[:, -1][keep[:, 0]]
    return logits
