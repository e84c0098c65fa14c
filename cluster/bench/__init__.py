"""Benchmarks: runtime (one forward), spec (the engine in process), serve (the cluster through gRPC),
kv (the KV-block ledger in process and its actor through RemoteKV)."""
