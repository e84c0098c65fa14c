"""model_runtime: model registry, weight preparation and the paged-KV tensor-parallel forward pass."""
