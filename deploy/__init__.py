"""The ``kvroute`` command (``serve``, ``router``, ``simulate``, ``bench``, ...) and the cluster
files beside it: ``ray-cluster.yaml`` for Ray's cluster launcher (AWS) and ``kuberay/`` for
KubeRay, both checked by ``tests/deploy/test_cluster_files.py``."""
