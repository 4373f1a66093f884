"""The GPU measurement without Ray (README.md here): measure.py runs each step of steps.py in its own
process under its own time limit; classify.py is the classification step and the CPU-side prepare; doc.py writes
docs/BENCHMARKS.md's GPU section from the stored results."""
