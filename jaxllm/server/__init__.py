"""`jaxllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over a jaxllm.engine."""
