"""Tools a user or maintainer runs: the server wrapper, model building, the benchmarks behind
the published figures and the GPU run scripts (see docs/performance.md)."""
