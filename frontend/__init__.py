"""An OpenAI-compatible HTTP frontend for models served by tritonserver.

`python -m frontend --triton-grpc localhost:8001 --port 9000` serves `/v1/chat/completions`,
`/v1/completions`, `/v1/models`, `/health` and `/metrics`, and forwards each request to Triton
over gRPC bidirectional streaming in the vLLM backend's request interface (so it fronts Tritium
and Triton's own vLLM backend alike). It imports nothing from `backend/`.
"""
