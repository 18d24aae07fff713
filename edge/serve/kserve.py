"""KServe v2 inference protocol for engines: `POST /v2/models/{name}/infer`, `GET /v2/models/{name}`.

Tensors come as {"name", "shape", "datatype", "data"} with data flat (row-major) or nested;
a wrong name, datatype or shape, or data whose length does not fit the shape, is a 400 that
says which input and what was expected. The wire types (`KSERVE_DTYPES`, `kserve_datatype`) and
request validation live in edge/engines/tensors.py, below both this module and the engine
backends; starlette is imported by `kserve_routes` only.
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from edge.engines.tensors import KSERVE_DTYPES, TensorSpec, check_feeds
from edge.errors import GpuContextLost, RequestError

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

__all__ = ["MAX_ELEMENTS", "kserve_routes"]

MAX_ELEMENTS = 1 << 31  # per tensor (and per dimension): past numpy's and the engines' int32 sizes


def _tensor(t: Any, i: int) -> tuple[str, np.ndarray]:
    where = f"inputs[{i}]"
    if not isinstance(t, dict):
        raise RequestError(f"{where} must be an object with name, shape, datatype, data", param="inputs")
    name, shape, dtype, data = t.get("name"), t.get("shape"), t.get("datatype"), t.get("data")
    if not isinstance(name, str):
        raise RequestError(f"{where}.name must be a string", param="inputs")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise RequestError(f"{where} ({name}): shape must be a list of non-negative integers", param="inputs")
    if dtype not in KSERVE_DTYPES:
        raise RequestError(f"{where} ({name}): datatype must be one of {sorted(KSERVE_DTYPES)}, "
                           f"found {dtype!r}", param="inputs")
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked below, by value
            arr = np.asarray(data, dtype=KSERVE_DTYPES[dtype])
    except OverflowError:  # integers past the datatype's range, or an infinity for an INT type
        raise RequestError(f"{where} ({name}): data holds a number outside the range of {dtype}",
                           param="inputs") from None
    except (TypeError, ValueError):
        raise RequestError(f"{where} ({name}): data is not a list of {dtype} numbers", param="inputs") from None
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        # Python's JSON parser reads NaN, Infinity, -Infinity, and 1e400 as infinity; a finite
        # number past the datatype's range (3.4e38 * 10 in FP32, 70000 in FP16) becomes one here
        raise RequestError(f"{where} ({name}): data holds {_first_bad(arr)}; every value must be a "
                           f"finite number within the range of {dtype}", param="inputs")
    count = math.prod(shape)  # exact: numpy's product wraps around at 2**63
    if count > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in shape):
        raise RequestError(f"{where} ({name}): shape {shape} holds {count} values, more than any "
                           f"tensor may ({MAX_ELEMENTS})", param="inputs")
    if arr.size != count:
        raise RequestError(f"{where} ({name}): {arr.size} values do not fill shape {shape} "
                           f"({count} values)", param="inputs")
    return name, arr.reshape(shape)


def _first_bad(arr: np.ndarray) -> str:
    i = int(np.flatnonzero(~np.isfinite(arr.ravel()))[0])
    v = float(arr.ravel()[i])
    what = "NaN" if v != v else "a number outside the range of the datatype (or Infinity)"
    return f"{what} at flat index {i}"


def _outputs(outputs: dict[str, np.ndarray], specs: dict[str, TensorSpec]) -> list[dict[str, Any]]:
    """The outputs as KServe JSON. JSON has no NaN or infinity: an output holding one (inputs
    that overflow inside the model) is the documented error `output_not_finite`, a 400 naming
    the output; never a 500 from the serialiser."""
    out = []
    for n, a in outputs.items():
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            bad = int(a.size - np.isfinite(a).sum())
            raise RequestError(f"outputs ({n}): the engine's output holds {bad} of {a.size} values that are "
                               "not finite (NaN or Infinity: the inputs overflow inside the model), which "
                               "JSON cannot carry", param="inputs", code="output_not_finite")
        out.append({"name": n, "shape": list(a.shape), "datatype": specs[n].datatype, "data": a.ravel().tolist()})
    return out


def _meta(name: str, worker: Any) -> dict[str, Any]:
    s = worker.session

    def io(specs: list[TensorSpec]) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": t.shape} for t in specs]

    return {"name": name, "versions": [worker.stored.key.model_sha256[:16]], "platform": s.platform,
            "inputs": io(s.inputs), "outputs": io(s.outputs), "profiles": s.profiles}


def served_engine(state: Any, name: str) -> tuple[str, Any]:
    """The engine a route names; 503 for one safe mode left out (naming why), else 404."""
    if name in state.left_out:
        raise RequestError(f"engine {name!r} is not served: {state.left_out[name]}", status=503,
                           code="engine_unavailable")
    if name not in state.engines:
        raise RequestError(f"engine {name!r} is not served here; engines: {sorted(state.engines)}",
                           status=404, code="model_not_found")
    return name, state.engines[name]


async def _run(state: Any, name: str, worker: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The engine's work, on its thread (in a batch where the engine batches); a lost CUDA
    context ends the service (ServiceState.fatal)."""
    try:
        return await worker.infer(feeds)
    except GpuContextLost as exc:
        state.fatal(f"engine {name}: {exc}")
        raise state.leaving() from None


def kserve_routes(state: Any, guarded: Any) -> list[Route]:
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def engine(request: Request) -> tuple[str, Any]:
        return served_engine(state, request.path_params["name"])

    async def metadata(request: Request) -> Response:
        async def handler(r: Request) -> Response:
            name, worker = engine(r)
            return JSONResponse(_meta(name, worker))
        return await guarded(request, handler)

    async def infer(request: Request) -> Response:
        async def handler(r: Request) -> Response:
            name, worker = engine(r)
            try:
                body = json.loads(await r.body())
            except (ValueError, UnicodeDecodeError) as exc:
                raise RequestError(f"request body is not valid JSON: {exc}") from None
            if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
                raise RequestError("request body must be an object with an 'inputs' list", param="inputs")
            feeds = dict(_tensor(t, i) for i, t in enumerate(body["inputs"]))
            check_feeds(worker.session, feeds)
            t0 = time.perf_counter()
            outputs = await _run(state, name, worker, feeds)
            specs = {t.name: t for t in worker.session.outputs}
            resp = {"model_name": name, "model_version": worker.stored.key.model_sha256[:16],
                    "outputs": _outputs(outputs, specs),
                    "parameters": {"infer_seconds": round(time.perf_counter() - t0, 6)}}
            if "id" in body:
                resp["id"] = body["id"]
            return JSONResponse(resp)
        return await guarded(request, handler)

    async def ready(request: Request) -> Response:
        ok = state.readiness()[0] == 200
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    return [Route("/v2/models/{name}", metadata, methods=["GET"]),
            Route("/v2/models/{name}/infer", infer, methods=["POST"]),
            Route("/v2/health/ready", ready, methods=["GET"])]
