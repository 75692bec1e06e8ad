"""Paged-attention and KV-store kernels: plain-torch reference (CPU) and Triton (GPU).

Not built yet: see the engine issue.
"""
