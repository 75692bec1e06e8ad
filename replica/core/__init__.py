"""The engine's core, vLLM v1's: requests, the scheduler and its waiting queue, the block
pool and KV cache manager, the scheduler's side of tier loads, the load report, outputs,
detokenizing and structured outputs. No torch model here."""
