"""Kubernetes/KubeRay deployment of specserve (manifests + the Serve application builder they name)."""
