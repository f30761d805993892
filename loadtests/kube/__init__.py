"""`make kube-test`: the Kubernetes manifests (kubernetes/) run with ``podman kube play`` and
checked end to end (``python -m loadtests.kube``; see __main__.py). Not collected by pytest."""
