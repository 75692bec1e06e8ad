"""A front door's client for ``vllm serve`` processes it did not start: the data plane
over HTTP (:mod:`.connection`, :mod:`.wire`) and the control side (:mod:`.control`)."""
