"""The project's own measurement harness that the product package does not ship: run from a checkout
(the GPU measurement: benchmarks/gpu/). `workflows bench NAME` (workflows/bench/) is the command for the rest."""
