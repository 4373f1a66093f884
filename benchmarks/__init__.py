"""The project's own measurements, run from a checkout and not shipped in the wheel: `python -m benchmarks.NAME`
(`make bench-NAME`) records a benchmark into benchmarks/results/ and docs/BENCHMARKS.md (benchmarks.record);
the GPU measurement: benchmarks/gpu/. `workflows bench NAME` (workflows/bench/) is the user's command."""
