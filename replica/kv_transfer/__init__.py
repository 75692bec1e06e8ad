"""KV between replicas: the source's leases and sender, the puller's fetcher."""
