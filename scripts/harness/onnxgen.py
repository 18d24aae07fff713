"""The demo model behind engines/mlp-demo.toml: a small MLP built with onnx.helper, fixed weights
from a seed, so that the whole engine path (build, store, serve, infer) runs in tests anywhere;
the same MLP deeper and wider (the batching benchmark's), and small models with a shape the
batcher must respect (edge.engines.dynamic_batching): a dynamic non-batch dim, a data-dependent failure, an
output that does not follow the batch, no batch dim at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["make_gather", "make_mlp", "make_rowsum", "make_static", "make_total"]


def make_mlp(path: str | Path, *, seed: int = 0, n_in: int = 16, hidden: int = 32, n_out: int = 8,
             depth: int = 1) -> Path:
    """x [batch, n_in] -> `depth` hidden layers of `hidden` (MatMul, Add, Relu) -> y [batch, n_out]."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    widths = [n_in] + [hidden] * depth + [n_out]
    nodes, inits, h = [], [], "x"
    for i, (a, b) in enumerate(zip(widths, widths[1:]), start=1):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        bias = (rng.standard_normal(b) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(bias, f"b{i}")]
        last = i == len(widths) - 1
        # h0, h1, h2 for the first layer: the demo's names (engines/mlp-demo.onnx is these bytes)
        mm, out = (f"h{3 * i - 3}", f"h{3 * i - 2}") if not last else ("y0", "y")
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [mm]), helper.make_node("Add", [mm, f"b{i}"], [out])]
        if not last:
            h = f"h{3 * i - 1}"
            nodes.append(helper.make_node("Relu", [out], [h]))
    return _save(path, nodes, "mlp_demo", [_info("x", ["batch", n_in])], [_info("y", ["batch", n_out])], inits)


def make_rowsum(path: str | Path) -> Path:
    """x [batch, n] FP32, n dynamic -> y [batch, 1] = the sum of each row times 2: requests with
    different n cannot be concatenated."""
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("ReduceSum", ["x2", "axes"], ["y"], keepdims=1)]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    return _save(path, nodes, "rowsum", [_info("x", ["batch", "n"])], [_info("y", ["batch", 1])], inits)


def make_gather(path: str | Path) -> Path:
    """x [batch, 4] FP32, i [batch, 1] INT64 -> y [batch, 1] = x[row, i]: an index past 3 makes
    ONNX Runtime fail at run time, for that row's request only."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1)]
    return _save(path, nodes, "gather", [_info("x", ["batch", 4]), _info("i", ["batch", 1], TensorProto.INT64)],
                 [_info("y", ["batch", 1])], [])


def make_total(path: str | Path) -> Path:
    """x [batch, 4] -> y [2 * batch, 4], x stacked on itself: a first dim that is dynamic on both
    sides but no batch dim (the output's rows are not the input's)."""
    from onnx import helper

    nodes = [helper.make_node("Concat", ["x", "x"], ["y"], axis=0)]
    return _save(path, nodes, "total", [_info("x", ["batch", 4])], [_info("y", ["twice", 4])], [])


def make_static(path: str | Path) -> Path:
    """x [2, 4] -> y [2, 4] = x + 1: no batch dim."""
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("Add", ["x", "one"], ["y"])]
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    return _save(path, nodes, "static", [_info("x", [2, 4])], [_info("y", [2, 4])], inits)


def _info(name: str, dims: list[int | str], elem: int | None = None) -> object:
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT if elem is None else elem, dims)


def _save(path: str | Path, nodes: list, name: str, inputs: list, outputs: list, inits: list) -> Path:
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="edge", producer_version="1")
    model.ir_version = 8  # readable by every ONNX Runtime and TensorRT parser in use on Jetsons
    onnx.checker.check_model(model)
    out = Path(path)
    out.write_bytes(model.SerializeToString(deterministic=True))
    return out
