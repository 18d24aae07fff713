"""The harness: `edge serve` run the way its unit runs it, and loaded the way clients load it.
What the tests (through the test kit, tests/kit, which re-exports it), the benchmarks
(scripts/benchmarks), the demo and the GPU check share; not shipped in the wheel.

- `pid1`: a PID-1 stand-in that socket-activates `edge serve` and receives its sd_notify datagrams
  (`PidOne`), and `dies_with_us` for any other server a run starts;
- `load`: client load (`ClientLoad`) and a flood of half-sent request heads (`half_heads`);
- `http`: one HTTP client (`call`, `get`, `post`) and a sample of /metrics (`metric`);
- `ggufgen`, `onnxgen`: tiny real GGUF and ONNX models written from a seed;
- `soak`: reloads that keep the model while clients load it, and the decode errors logged.

On the path as `harness`: pytest's pythonpath and `scripts/bench` put scripts/ there, and a
script in scripts/ finds it beside itself.
"""

import sys

from harness.http import call, get, metric, post
from harness.load import ClientLoad, LoadResult, half_heads
from harness.pid1 import Child, Notification, PidOne, ServiceExited, describe_status, dies_with_us

__all__ = ["EDGE", "Child", "ClientLoad", "LoadResult", "Notification", "PidOne", "ServiceExited", "call",
           "describe_status", "dies_with_us", "get", "half_heads", "metric", "post"]

EDGE = [sys.executable, "-m", "edge.cli"]  # the `edge` command line in this interpreter
