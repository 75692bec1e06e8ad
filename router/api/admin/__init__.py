"""The endpoints beside the completions: vLLM's ``/tokenize`` and ``/detokenize``, ``GET
/fleet`` (the fleet as this front door sees it, for operators) and the LoRA admin endpoints
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``). A room of its own because none of
them generates: the app mounts them next to the completions, with the same authentication
(admin keys for ``/fleet`` and LoRA), and no completion passes through them."""
