"""Benchmarks of the service: load generators, a batch's cost in the engine, reliability runs
(``python -m bench.serving.<name>``)."""
