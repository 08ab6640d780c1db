"""The pdserve router: OpenAI-compatible HTTP front end over ZMQ-connected workers.

Modules: ``app`` (FastAPI app factory and routes), ``openai_schemas`` (request models),
``completions`` / ``chat`` (endpoint logic and response shapes), ``session`` (one request's life
in the router), ``inflight`` (the in-flight table), ``registry`` (workers, health, routing policy),
``worker_client`` (ZMQ DEALER per worker), ``detok`` (incremental text + stop strings),
``streaming`` (SSE), ``metrics`` (Prometheus), ``errors`` (OpenAI error shape).
"""
