"""What runs in a front-door process: prefix index, routing policy, load view, tenants, HTTP.

:mod:`.index` (prefix index from KV events), :mod:`.policy` (``kv`` and baselines),
:mod:`.load` (the load view: replicas' reports plus in-flight accounting), :mod:`.tenants`,
:mod:`.frontdoor` (replicas, event streams, retries) and :mod:`.server` (the OpenAI-compatible
HTTP API). Depends on :mod:`kvroute.events` alone.
"""
