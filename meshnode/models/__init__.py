"""Models: GGUF metadata (gguf_info), the store and default model (store), layer slices
(slicer), model-package.json (package) and random-weight test models (synthetic).

Nothing here imports llama_cpp; see docs/models.md.
"""
