"""The Ray Serve application: ingress -> scheduler (engine) -> {drafter, verifier (TP ranks), KV manager actor}."""
