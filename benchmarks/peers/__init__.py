"""The pieces of ``benchmarks/peers_vllm.py``, kvroute against vLLM (the script is the command).

:mod:`.setup` (the fixed setup, progress, errors), :mod:`.procs` (ports, HTTP, /proc,
servers), :mod:`.pieces` (the run's settings, ``vllm serve`` backends, the bench client),
:mod:`.engines` and :mod:`.routers` (the two phases) and :mod:`.report` (tables, plot).
"""
