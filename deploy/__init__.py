"""The ``kvroute`` command (``serve``, ``router``, ``stop``, ``key``, ``simulate``, ``bench``,
...) and the operator's files beside it: ``ray-cluster.yaml`` for Ray's cluster launcher
(AWS), ``kuberay/`` for KubeRay (RayCluster, Service, Secret, PodMonitor), both checked by
``tests/deploy/test_cluster_files.py``; ``tenants.example.toml``, a tenants file; and
``grafana/kvroute.json``, a dashboard over ``/metrics`` (``tests/deploy/test_grafana.py``)."""
