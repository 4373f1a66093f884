"""The chat task's continuous-batching engine: every request in flight shares each step; one that ends
leaves the batch at once, and a waiting one joins at the next step without the batch draining first.

Rooms:
- `loop`: the Engine, its decode thread, one forward per step (workflows.tasks.chat.engine.loop);
- `scheduler`: admission (a bounded queue, deadlines) and the tokens of each step (prefill in chunks
  beside decoding);
- `cache`: the KV cache written in place (a slot per request) and the attention that reads it;
- `linear`: fp32 Linear layers computing with weights packed once for oneDNN (on a CPU);
- `sampler`: the next token of every row together on the model's device (logit bias, penalties,
  constraints, greedy or temperature and top-p, log probabilities);
- `requests`: what callers hold (Generation, Delta, TokenLogprob) and the errors of `submit`;
- `metrics`: what the engine reports per step (StepReport) to a watcher (EngineMetrics).
"""

from workflows.tasks.chat.engine.loop import BASE, Engine, model_device
from workflows.tasks.chat.engine.metrics import EngineMetrics, StepReport
from workflows.tasks.chat.engine.requests import (
                                                  FINISH_REASONS,
                                                  Delta,
                                                  Generation,
                                                  ModelNotFound,
                                                  PromptTooLong,
                                                  QueueFull,
                                                  TokenLogprob,
)

__all__ = ["BASE", "FINISH_REASONS", "Delta", "Engine", "EngineMetrics", "Generation", "ModelNotFound",
           "PromptTooLong", "QueueFull", "StepReport", "TokenLogprob", "model_device"]
