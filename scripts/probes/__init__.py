"""One-off diagnostics: each answers a question about the engine or a kernel on the GPU, and is
not behind a published figure. Run from the repository root as `python3 -m scripts.probes.NAME`."""
