"""Models: GGUF metadata (gguf_info), the store (store: resolve_model over the on-disk
index, the catalog of known models and the default, and fetch), layer slices (slicer),
model-package.json (package) and random-weight test models (synthetic).

Nothing here imports llama_cpp; see docs/models.md.
"""
