"""vLLM's ``AsyncLLM`` as a replica's engine: settings, its command line, the plugin vLLM
loads in its processes."""
