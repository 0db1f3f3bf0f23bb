"""The load generator, its workloads and its report: `tritium bench` (installed as `tritium.bench`),
or `python -m benchmarks.loadgen.bench` from a checkout."""
