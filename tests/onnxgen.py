"""The demo model behind engines/mlp-demo.toml: a small MLP built with onnx.helper, fixed weights
from a seed, so that the whole engine path (build, store, serve, infer) runs in tests anywhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["make_mlp"]


def make_mlp(path: str | Path, *, seed: int = 0, n_in: int = 16, hidden: int = 32, n_out: int = 8) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((n_in, hidden)) / np.sqrt(n_in)).astype(np.float32)
    b1 = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((hidden, n_out)) / np.sqrt(hidden)).astype(np.float32)
    b2 = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["y0"]),
        helper.make_node("Add", ["y0", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp_demo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])],
        initializer=[numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="edge", producer_version="1")
    model.ir_version = 8  # readable by every ONNX Runtime and TensorRT parser in use on Jetsons
    onnx.checker.check_model(model)
    out = Path(path)
    out.write_bytes(model.SerializeToString(deterministic=True))
    return out
