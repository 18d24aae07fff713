"""Engines: the store (key -> file, manifest, atomic writes), offline builds, runtime loading.

Nothing here imports TensorRT, cuda-python or ONNX Runtime at module level; each backend is loaded
by the call that needs it.
"""
