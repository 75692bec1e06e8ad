"""One engine per accelerator: block pool, scheduler, model runner, sampling, Ray actor.

Not built yet: see the engine issue. The package exists so the namespace is whole.
"""
