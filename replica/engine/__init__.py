"""The engine: :class:`.llm_engine.LLMEngine` (one step at a time), its thread and queues
(:mod:`.async_engine`), its configuration, and the surface a replica uses of any engine."""
