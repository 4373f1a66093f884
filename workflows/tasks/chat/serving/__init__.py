"""The chat wing's serving: the predictor of a registered chat model, for HTTP, batch generation and
evaluation alike, split by concern.

It owns the predictor that the task hands to the platform (`predictor.ChatPredictor`, and
`chat_http_contract`, the OpenAI routes it answers with), the served model and its engine, loaded on
the replica's device in its precision (`loading`), prompts as token ids and the tokenizer's grammars and
token text (`prompts`), the LoRA adapters served beside the base and the checks that admit one
(`served_adapters`), and the engine's figures on Prometheus (`metrics`).

The top room of the wing, below only the task's own class: it may import every other room (`engine`,
`grammar`, `adapters`, `training`, `openai`), and none imports it.
"""

from workflows.tasks.chat.serving.predictor import ChatPredictor, chat_http_contract

__all__ = ["ChatPredictor", "chat_http_contract"]
