"""The chat wing's training side: the model the task builds, trains, exports and loads back, and the data
it trains on.

It owns the base model (`smollm2`, the packaged SmolLM2 converted once per node; a directory, an
object-store URI or a registered model through `model.resolve_dir`), LoRA or full fine-tuning and greedy
decoding (`model`), the registered artifact and a registered model loaded back (`model.export_chat`,
`model.load_trained`), the chat rows as token ids with assistant-only labels, preprocessed on Ray Data
and batched (`data`), and the evaluation of processed rows (`scoring`: greedy answers, token loss, the
base model's figures beside them).

It may import the `adapters` room (a registered adapter is loaded through its checks); never the
OpenAI API or serving, which sit above it. Nothing is re-exported here: the task's class imports `model`
and `smollm2` on every config check, and `data` and `scoring` (numpy, pandas, Ray Data) only when a
stage runs.
"""
