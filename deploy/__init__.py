"""Kubernetes/KubeRay deployment of specserve: the kustomize manifests, the Serve application builder they name
(serve_app) and the init container's model-cache job (prepare_models)."""
