"""The chat wing's continuous-batching engine: every request in flight shares each step; one that ends
leaves the batch at once, and a waiting one joins at the next step without the batch draining first.

The lowest room of the wing: it imports no other room (only torch and transformers), and every room
above may import it. What it knows of a request is its token ids and `SamplingParams`; a constraint on
its tokens (a grammar) comes in as a `TokenConstraint`, whatever implements it.

Our own loop, not transformers' continuous batching (`model.init_continuous_batching`, 5.23): its
manager takes one generation config and one seed for all requests (no per-request seed, so no
repeatable sampling beside other requests), has no stop strings, runs one model where requests here
pick a LoRA adapter each, and was measured at about half the tokens/s of static batching with plain
`generate` on CPU (26 against 50 at 16 prompts, SmolLM2-135M), with a warm-up of several seconds. Its
cache is discussed in workflows.tasks.chat.engine.cache.

Modules:
- `loop`: the Engine, its decode thread, one forward per step;
- `forward`: one forward of a step's tokens (the model's call, or the compiled one);
- `compiled`: the decoder's layers compiled with inductor (weights frozen and packed, attention a custom op);
- `lora`: LoRA adapters' rows in the compiled forward (their matrices a custom op, per row);
- `device`: where a model's weights are, and their dtype;
- `scheduler`: admission (a bounded queue, deadlines) and the tokens of each step (prefill in chunks
  beside decoding);
- `costs`: what a step costs, learned from the steps that ran (the prefill budget in time);
- `cache`: the KV cache written in place (a slot per request) and the attention that reads it;
- `linear`: fp32 Linear layers computing with weights packed once for oneDNN (on a CPU);
- `threads`: the decode thread's OpenMP workers its own (the building thread's pool released);
- `sampler`: the next token of every row together on the model's device (logit bias, penalties,
  constraints, greedy or temperature and top-p, log probabilities);
- `params`: a request's sampling settings (`SamplingParams`, `TokenConstraint`) and its seeded generator;
- `text`: a sequence's text as tokens come (incremental detokenization, stop strings);
- `requests`: what callers hold (Generation, Delta, TokenLogprob) and the errors of `submit`;
- `metrics`: what the engine reports per step (StepReport) to a watcher (EngineMetrics);
- `measure`: open-loop runs of the engine against static batching, for a quick look.
"""

from workflows.tasks.chat.engine.device import model_device
from workflows.tasks.chat.engine.loop import BASE, Engine
from workflows.tasks.chat.engine.metrics import EngineMetrics, StepReport
from workflows.tasks.chat.engine.params import MAX_LOGPROBS, SamplingParams, TokenConstraint
from workflows.tasks.chat.engine.requests import (
                                                  FINISH_REASONS,
                                                  Delta,
                                                  EngineStopped,
                                                  Generation,
                                                  ModelNotFound,
                                                  PromptTooLong,
                                                  QueueFull,
                                                  TokenLogprob,
)
from workflows.tasks.chat.engine.text import TextState

__all__ = ["BASE", "FINISH_REASONS", "MAX_LOGPROBS", "Delta", "Engine", "EngineMetrics", "EngineStopped", "Generation",
           "ModelNotFound", "PromptTooLong", "QueueFull", "SamplingParams", "StepReport", "TextState",
           "TokenConstraint", "TokenLogprob", "model_device"]
