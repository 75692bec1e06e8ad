"""The ``kvroute`` command and the Ray / Kubernetes wiring."""
