"""The KV cache below the device: host memory and local disk (a private folder, blocks
sealed at rest, reads under a deadline), their writer and loader threads."""
