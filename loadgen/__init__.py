"""``kvroute bench``: an HTTP load generator for OpenAI-compatible servers."""
