"""The HTTP front door: the FastAPI app, intake (admit, parse, validate, tokenize),
responses and SSE, OpenAI schemas and errors, /metrics, /fleet and the LoRA admin endpoints."""
