"""model_runtime: model registry, weight preparation and the paged-KV tensor-parallel forward pass."""

from model_runtime.huge_pages import enable as _enable_huge_pages

_enable_huge_pages()  # before any weight is allocated in this process (huge_pages.py says why)
