"""Prefix index, routing policy, tenants and the OpenAI-compatible front door.

Not built yet: see the router issues.
"""
