"""The engine: continuous batching and the speculative round, in plain Python (no Ray)."""
