"""The GPU measurement (README.md here): measure.py runs each step of steps.py in its own process under its own
time limit; pipeline.py is the product path through Ray Train (the Ray that ray_pack.py packs), classify.py,
chat.py and generate.py the other steps with their CPU-side prepare; carry.py packs what one device call
carries; doc.py writes docs/BENCHMARKS.md's GPU section from the stored results."""
