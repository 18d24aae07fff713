"""docs/fleet.md's metric tables, from what `/metrics` exports: a real `edge serve` (a tiny GGUF
model and the demo ONNX engine, so that every per-model and per-engine family has a series) on a
state dir that has seen what the history families count (an OTA version installed and committed
by the real `edge ota` CLI, a crash record, a reload), scraped once after a completion and an
inference. Each family's name as it is exposed (`_total`, `_info`), its type and its labels come
from the scrape; a family the scrape shows with no series (a counter nothing has counted yet)
takes the label names its collector declares, collected in this process from the same code.

The meaning column is the page's own text for that family where it has one (prose with links,
written by hand, kept across regenerations), else the family's HELP: a new family appears with
its HELP, a removed one disappears, and labels and types are never written by hand.
"""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from docgen.markdown import cell, code
from docgen.paths import ROOT

_ROW = re.compile(r"^\| `([a-z_:]+)` \|[^|]+\|[^|]*\| (.*) \|$", re.M)
_SUFFIX = {"counter": "_total", "info": "_info"}


def _config(d: Path, tiny: Path, store: Path) -> Path:
    recipe = ROOT / "engines" / "mlp-demo.toml"
    cfg = d / "edge.toml"
    cfg.write_text(f'[server]\nport = 0\n[paths]\nstate_dir = "{d / "state"}"\ncache_dir = "{d / "cache"}"\n'
                   f'[[models]]\nname = "tiny"\npath = "{tiny}"\nn_ctx = 256\n'
                   f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{recipe}"\nstore = "{store}"\n'
                   '[warmup]\ndecode_tokens = 4\n')
    return cfg


def _history(d: Path, tiny: Path) -> None:
    """What the history families count, made by the code that makes it on a device: an OTA
    version installed and committed (`edge ota`), and a crash while serving (its record)."""
    import time

    from edge.fleet.history import CRASH
    from edge.ota.bundle import build_bundle, keygen
    from edge.timing import write_report
    from harness import EDGE

    pub = keygen(d / "signing.key")
    bundle = d / "v1.edgeb"
    build_bundle(bundle, version="1.0.0", files=[(tiny, "models/tiny.gguf", "model", None)],
                 config='[[models]]\nname = "tiny"\npath = "models/tiny.gguf"\n', key=d / "signing.key")
    device = d / "device.toml"
    device.write_text(f'[paths]\nstate_dir = "{d / "state"}"\n[ota]\npubkey = "{pub}"\n'
                      f'[[models]]\nname = "tiny"\npath = "{tiny}"\n')
    for args in (["install", str(bundle), "--no-activate"], ["commit"]):
        _run([*EDGE, "ota", *args, "--config", str(device)])
    write_report({"started_unix": time.time() - 60, "ready_s": 1.0, "pid": 1, "phase": "serving",
                  "signal": "SEGV"}, d / "state", kind=CRASH)


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:])}: exit {r.returncode}: {r.stderr[-2000:]}")


def _scrape() -> str:
    from edge.device.identity import detect
    from edge.engines.build import build_engine
    from edge.engines.recipe import load_recipe
    from edge.engines.store import EngineStore
    from harness import EDGE, PidOne, get, post
    from harness.ggufgen import write_tiny_llama

    with tempfile.TemporaryDirectory(prefix="edge-gen-metrics-") as tmp:
        d = Path(tmp)
        tiny = write_tiny_llama(d / "tiny.gguf")
        store = EngineStore(d / "store")
        build_engine(load_recipe(ROOT / "engines" / "mlp-demo.toml"), "onnxruntime", store, detect(), log=lambda s: None)
        _history(d, tiny)
        cfg = _config(d, tiny, d / "store")
        with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
            pid1.start()
            pid1.wait_for("READY", "1")
            post(pid1.address, "/v1/completions", {"prompt": "the a", "max_tokens": 2})
            post(pid1.address, "/v2/models/mlp/infer",
                 {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})
            _run([*EDGE, "reload", "--config", str(cfg)])
            status, text = get(pid1.address, "/metrics")
            pid1.stop()
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return text


def _declared() -> tuple[dict[str, tuple[str, ...]], set[str], set[str]]:
    """Label names each family's collector declares (collected here, from the same code, with
    nothing served and an empty state dir), the names the serving app's own registry holds, and
    the info families' exposed names (the text format writes an info family as a gauge)."""
    from edge.fleet.metrics import FleetCollector
    from edge.serve.metrics import Metrics

    out: dict[str, tuple[str, ...]] = {}
    m = Metrics()
    for value in vars(m).values():
        if hasattr(value, "_labelnames") and hasattr(value, "_name"):
            out[value._name] = tuple(value._labelnames)
    serving = {f.name for f in m.registry.collect()}
    for f in m.registry.collect():
        out.setdefault(f.name, tuple(getattr(f, "_labelnames", ())))
    infos = set()
    with tempfile.TemporaryDirectory() as tmp:
        for f in FleetCollector(Path(tmp), lambda: None, device=dict, gpu_devices=lambda: None).collect():
            out.setdefault(f.name, tuple(getattr(f, "_labelnames", ())))
            if f.type == "info":
                infos.add(f.name + "_info")
    return out, serving, infos


def _kept(page: str) -> dict[str, str]:
    """The meaning the page gives each family now (its generated tables' last column)."""
    return {name: meaning for name, meaning in _ROW.findall((ROOT / page).read_text())}


@functools.cache
def tables() -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    declared, serving, infos = _declared()
    kept = _kept("docs/fleet.md")
    rows: dict[str, list[str]] = {"serving": [], "identity": []}
    families = list(text_string_to_metric_families(_scrape()))
    names = {f.name for f in families}
    for fam in families:
        if fam.name.endswith("_created") and fam.name.removesuffix("_created") in names:
            continue  # a counter's or histogram's `_created` series, written as a family of its own
        seen: dict[str, None] = {}
        for s in fam.samples:
            seen.update(dict.fromkeys(k for k in s.labels if k not in ("le", "quantile")))
        if not fam.samples and fam.type == "info":
            raise RuntimeError(f"{fam.name}_info has no series in the scrape: its labels are unknown "
                               "(extend scripts/docgen/metrics.py's scenario)")
        own = declared.get(fam.name.removesuffix("_info"), declared.get(fam.name, ()))
        # in the order the code declares them where they are the same names, else as scraped
        labels = own if not fam.samples or set(own) == set(seen) else tuple(seen)
        exposed = fam.name + _SUFFIX.get(fam.type, "")
        meaning = kept.get(exposed) or cell(fam.documentation)
        kind = "gauge (info)" if exposed in infos else fam.type
        row = f"| {code(exposed)} | {kind} | {', '.join(code(label) for label in labels)} | {meaning} |"
        rows["serving" if fam.name in serving else "identity"].append(row)
    head = ["| family | type | labels | meaning |", "|---|---|---|---|"]
    return {k: "\n".join(head + v) for k, v in rows.items()}
