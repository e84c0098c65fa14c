"""Benchmarks: runtime (one forward), spec (the engine in process), serve (the cluster through gRPC)."""
