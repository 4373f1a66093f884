"""The chat task: a causal LM fine-tuned on conversations (the `Chat` task class belongs here, written
with the training side), served through an OpenAI-compatible API with continuous batching
(workflows.tasks.chat.serving: `chat_predictor` and `chat_http_contract` are what its `predictor` and
`http_contract` return)."""
