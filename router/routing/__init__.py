"""Where a request goes: the prefix index rebuilt from KV events (and its lower tiers),
the load view, the ``kv`` policy with its LoRA pricing, and the baselines it is measured against."""
