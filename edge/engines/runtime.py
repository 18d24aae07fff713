"""Engine sessions at serving time: deserialize a stored engine and run it.

`session_from_engine(stored, data)` picks the backend from the key: TensorRT
(edge/engines/trt_session.py: the primary CUDA context on the calling thread, cuda-python
buffers, `execute_async_v3`) or ONNX Runtime (a session over the prebuilt ORT-format model,
with graph optimization off because it was done at build time). Call it on the thread that will
serve the engine, and `close()` the session there too. What sessions share (tensor specs, profile
choice, request checks) is in edge/engines/tensors.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge.engines.store import StoredEngine
from edge.engines.tensors import EngineSession, TensorSpec
from edge.errors import EngineError, RequestError, require

__all__ = ["OrtSession", "session_from_engine"]


class OrtSession:
    platform = "onnxruntime_ort"

    def __init__(self, stored: StoredEngine, data: bytes) -> None:
        ort = require("onnxruntime", "ort", "serving ONNX Runtime engines")
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done at build time
        so.add_session_config_entry("session.load_model_format", "ORT")
        # ORT's pool threads spin after each run by default, taking the cores the event loop and
        # llama.cpp need: with spinning off the service's CPU per request fell from 10.8 to 6.5 ms
        # one at a time and 4.4 to 1.9 ms batched (scripts/bench engines --batching, 2 cores)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        state = getattr(getattr(ort, "capi", None), "onnxruntime_pybind11_state", None)
        # how a kernel refuses a validated request's data (an index past its tensor: FAIL) or
        # an argument (INVALID_ARGUMENT); anything else (memory, a broken engine) is the engine's
        self._refusals = tuple(getattr(state, n, _Never) for n in ("Fail", "InvalidArgument"))
        try:
            self._sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise EngineError(f"{stored.path}: ONNX Runtime could not load the engine: {exc}") from None
        self.profiles = stored.meta.get("build", {}).get("profiles", [])
        to_np = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                 "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
                 "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}

        def spec(t: Any) -> TensorSpec:
            return TensorSpec(t.name, to_np[t.type], [d if isinstance(d, int) else -1 for d in t.shape])

        self.inputs = [spec(t) for t in self._sess.get_inputs()]
        self.outputs = [spec(t) for t in self._sess.get_outputs()]

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs. Inputs a kernel refuses at run time (what validation cannot see: an index
        past its tensor) are a 422 `engine_failed` naming the operator; any other failure is an
        EngineError."""
        names = [o.name for o in self.outputs]
        try:
            return dict(zip(names, self._sess.run(names, feeds)))
        except self._refusals as exc:
            raise RequestError(f"the engine failed on these inputs: {exc}", status=422, param="inputs",
                               code="engine_failed") from None
        except Exception as exc:
            raise EngineError(f"ONNX Runtime failed: {exc}") from None

    def close(self) -> None:
        self._sess = None


class _Never(Exception):
    """Raised by nothing: the stand-in for an exception class an ONNX Runtime lacks."""


def session_from_engine(stored: StoredEngine, data: bytes) -> EngineSession:
    if stored.key.backend == "tensorrt":
        from edge.engines.trt_session import TrtSession

        return TrtSession(stored, data)
    return OrtSession(stored, data)
