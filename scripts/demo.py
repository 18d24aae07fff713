"""The demo behind scripts/demo: socket-activated start on the embedded default, one question
asked while the service is still starting, the answer, the start report, a clean stop.
`scripts/demo --svg FILE` also draws the start as a timeline (docs/demo-start.svg is one).

If the service dies (a bad config, a native fault), the demo says so within a second, with its
exit status or signal and the tail of its log, and exits 1: the question waits through
harness.PidOne.while_running (scripts/harness/pid1.py), which watches the service while the answer is awaited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from edge.serve.client import request
from harness import PidOne, ServiceExited  # scripts/harness: beside this file, so on sys.path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Question: What is the capital of France?\nAnswer:"


def ask(address: tuple[str, int], body: dict) -> dict:
    return json.loads(request(address, "POST", "/v1/completions", body)[1])


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    home = Path(os.environ.get("EDGE_HOME", ROOT / ".data"))
    env = {**os.environ, "EDGE_HOME": str(home)}
    env.pop("EDGE_CONFIG", None)
    edge = [sys.executable, "-m", "edge.cli"]
    with PidOne([*edge, "serve"], env=env) as pid1:
        print(f"demo: socket {pid1.address[0]}:{pid1.address[1]} bound by the harness (as systemd "
              "would); starting `edge serve` on the embedded Gemma 3 270M", file=sys.stderr)
        t0 = time.monotonic()
        child = pid1.start()
        print(f"demo: `edge serve` is pid {child.pid}; asking at once", file=sys.stderr)
        body = {"prompt": QUESTION, "max_tokens": 8, "temperature": 0, "stop": ["\n"]}
        try:  # sent before the service is ready; a service that dies meanwhile is noticed at once
            answer = pid1.while_running(ask, pid1.address, body, what="the answer to the question")
            t_answer = time.monotonic() - t0
            ready = pid1.wait_for("READY", "1")
        except ServiceExited as exc:
            late = time.monotonic() - (child.exited_at or time.monotonic())
            print(f"\ndemo: failed: {exc}\n(noticed {late:.2f} s after it exited)", file=sys.stderr)
            return 1
        print(f"\n{QUESTION}{answer['choices'][0]['text']}")
        print(f"\n(asked at once, answered {t_answer:.2f} s after exec; READY=1 came at "
              f"{ready.at - t0:.2f} s: \"{ready.fields.get('STATUS')}\")\n")
        svg = ["--svg", sys.argv[sys.argv.index("--svg") + 1]] if "--svg" in sys.argv[:-1] else []
        subprocess.run([*edge, "status", *svg], env=env, check=True)  # the real CLI, as a user runs it
        code = pid1.stop()
        print(f"\nstopped with SIGTERM: exit status {code}", file=sys.stderr)
        if code != 0:
            print(pid1.log_tail(), file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
