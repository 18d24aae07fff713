"""The test kit (not shipped in the wheel): a PID-1 stand-in that socket-activates `edge serve`
and receives its sd_notify datagrams, client load, one HTTP client, the `edge` command line and
config files (kit.configs), chats in turns on a loaded model (kit.chats), a consumer of a model's
slots (kit.slots), and the package's layout checks (kit.layout, for test_layout).

Tests import it as `kit` (tests/ is on sys.path through conftest.py); scripts/ put tests/ on
sys.path the same way (scripts/benchlib.py, scripts/demo.py).
"""

from kit.configs import EDGE, write_config
from kit.http import call, get, metric, post
from kit.load import ClientLoad, LoadResult, half_heads
from kit.pid1 import Child, Notification, PidOne, ServiceExited, describe_status, dies_with_us

__all__ = ["EDGE", "Child", "ClientLoad", "LoadResult", "Notification", "PidOne", "ServiceExited", "call",
           "describe_status", "dies_with_us", "get", "half_heads", "metric", "post", "write_config"]
