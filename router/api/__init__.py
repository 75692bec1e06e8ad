"""The HTTP front door: the FastAPI app, intake (admit, parse, validate, tokenize),
responses and SSE, OpenAI schemas and errors, /metrics; beside them, rooms of their own for
what agents use (:mod:`.agents`), the endpoints beside the completions (:mod:`.admin`) and
several choices per request (:mod:`.choices`)."""
