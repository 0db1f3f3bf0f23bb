"""An OpenAI-compatible HTTP frontend for models served by tritonserver.

`python -m frontend --triton-grpc localhost:8001 --port 9000` serves `/v1/chat/completions`,
`/v1/completions`, `/v1/responses`, `/v1/models`, vLLM's `/tokenize`, `/detokenize`, `/version` and
`/ping`, `/health` and `/metrics`, and forwards each request to Triton
over gRPC bidirectional streaming in the vLLM backend's request interface (so it fronts Tritium
and Triton's own vLLM backend alike). It imports nothing from `backend/`.
"""

# Tritium's version (the engine, its Triton backend and this frontend are released together):
# GET /version answers it, as vLLM's server answers its own.
__version__ = "0.1.0"
