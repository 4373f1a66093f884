"""The chat wing's OpenAI-compatible API: what a served chat model answers over HTTP.

It owns OpenAI's request bodies, every field honoured or refused, every list bounded (`protocol`, its
messages, tools and response formats in `parts`); the routes mounted on the
replica's app, their errors in OpenAI's shape and the multiplexed loading of adapters (`routes`); a
request turned into the engine's rows (`plan`: prompts, each choice's SamplingParams and grammar); tool
calls through the chat template and read back from the answer (`tools`); and the answer in OpenAI's
shapes, one choice at a time (`choices`) and whole or streamed as Server-Sent Events (`streaming`).

It may import the `engine` (what it submits, the deltas it reads, the errors it answers) and `grammar`
(the constraints of structured output and tool calls). The predictor it serves is the serving room's,
above it: the routes and the plan call it by its methods and import nothing of it.
"""
