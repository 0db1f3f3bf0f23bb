"""The scheduling core: the scheduler, the KV-cache manager and its block pools, sequences.
Plain Python (tests/test_layout.py holds it to the standard library and backend's records)."""
