"""model_runtime: model registry, weight preparation and the paged-KV tensor-parallel forward pass."""

from model_runtime.heap import keep_large_allocations as _keep_large_allocations
from model_runtime.huge_pages import enable as _enable_huge_pages

_enable_huge_pages()  # before any weight is allocated in this process (huge_pages.py says why)
_keep_large_allocations()  # the forward's large activations on reused heap pages (heap.py says why)
