"""The test kit (not shipped in the wheel): the `edge` command line and config files
(kit.configs), self-signed TLS certificates (kit.tls), chats in turns on a loaded model (kit.chats),
a consumer of a model's slots (kit.slots), the package's layout checks (kit.layout, for
test_layout), and what the tests share with the benchmarks, the demo and the GPU check,
re-exported from the harness (scripts/harness): a PID-1 stand-in that socket-activates `edge serve`
and receives its sd_notify datagrams, client load, one HTTP client.

Tests import it as `kit` (tests/ is on sys.path through conftest.py, scripts/ through pytest's
pythonpath in pyproject.toml). Nothing under scripts/ imports it but the GPU check's doubles.
"""

from harness import (EDGE, Child, ClientLoad, LoadResult, Notification, PidOne, ServiceExited, call,
                     describe_status, dies_with_us, get, half_heads, metric, post)
from kit.configs import write_config

__all__ = ["EDGE", "Child", "ClientLoad", "LoadResult", "Notification", "PidOne", "ServiceExited", "call",
           "describe_status", "dies_with_us", "get", "half_heads", "metric", "post", "write_config"]
