"""One-off diagnostics: each answers a question about the engine or a kernel on the GPU; none is
behind the current tables of docs/performance.md. Run from the repository root as `python3 -m scripts.probes.NAME`."""
