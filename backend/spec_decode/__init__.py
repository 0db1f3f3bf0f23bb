"""Speculative decoding, in one place: the proposers (proposer.py says what one is: n-gram
lookup on the engine's side, ngram.py; a draft model or EAGLE heads in the worker,
draft_model.py, eagle.py), the verification of proposals (verification.py), the draft
vocabulary check (vocabulary.py) and the counters (metrics.py). The engine and the worker call
it; its modules sit at the level of what they use (tests/test_layout.py)."""
