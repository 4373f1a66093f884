"""The chat wing's vLLM engine (serve.generate.engine: vllm): vLLM's engine behind the same OpenAI routes,
limits and metrics as the builtin one, for models beyond one device (tensor and pipeline parallelism) and
GPUs (CUDA graphs, paged attention).

Imports the rooms below it (engine: the contract it keeps, Generation, Delta, the errors; adapters: the
registry's checks on an adapter's files); serving imports it.

Modules:
- `worker`: the Ray actor owning vLLM's AsyncLLM, run in the vLLM venv's Python, importing nothing of ours;
- `engine`: VllmEngine, the builtin engine's interface over that actor (admission, deadlines, metrics);
- `launch`: the actor placed (beside the replica, or a placement group of GPUs) and vLLM's arguments;
- `model_files`: the folders vLLM reads, made from what our checks passed;
- `grammar_text`: a request's grammar as the Lark text vLLM's guidance backend takes.
"""
