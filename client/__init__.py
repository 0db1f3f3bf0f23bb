"""The command-line client: `python -m tritium.client PROMPT` streams a completion from a running server."""
