"""OTA with the content store, on the embedded Gemma: JSON to stdout (and .bench/ota.json).

1. Bytes shipped for a config-only update: the full bundle vs the thin one (`--base` the version
   before), same version, same signed file list.
2. Disk used by 3 installed versions that share the model: "before" is what the layout without
   the store used (every version its own copy: the sum of every version's file sizes), "after"
   is what the OTA root holds now (blocks of each inode counted once).
3. A reload activation after a config-only OTA (`edge ota install --reload`, thin bundle) under
   8 clients: the reload report (kept, loaded, its phases: no page_in, no model_load when the
   model is kept) and the worst request latency during the activation vs the steady p99.
4. What the check before a switch costs (edge/ota/recheck.py: every file of the version hashed
   in full against its signed manifest): `edge ota rollback` to the version before, and the
   install of the newer version again (already on disk), each re-hashing the 253 MB model;
   with the model in the page cache (warm) and dropped from it (cold: posix_fadvise DONTNEED on
   that one file, nothing else is evicted; in a VM the host's cache may still hold it). Each
   command's own `checked.seconds` and its wall time, beside `sha256sum` of the same file in the
   same cache state (the peer: what an operator would run), in alternating order, `--rounds`
   times; medians and the ratio of the rollback's check to the peer. The thin bundle's install
   hashes the object in its content check already, and its check reuses that (`checked.seconds`
   about 0): its wall time holds the cost.

The machine's load average is printed with the numbers (at start and end): numbers from a busy
machine say the script works, not how fast it is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


from benchmarks.load import TimedLoad, correct, in_windows, stats
from benchmarks.common import EDGE, REQUEST, emit, env_for_bench, gemma_path
from harness import PidOne

from edge.serve.bench import percentile


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def config(folder: Path, model: Path, revision: int) -> str:
    """A version's config: the same model and model settings, another [server] setting."""
    return (f'[paths]\nstate_dir = "{folder / "svc-state"}"\ncache_dir = "{folder / "svc-cache"}"\n'
            f'[server]\nmax_queue = {60 + revision}\n'
            f'[[models]]\nname = "gemma"\npath = "models/{model.name}"\nn_ctx = 2048\n')


def edge_ota(device: Path, *args: str) -> dict[str, Any]:
    p = subprocess.run([*EDGE, "ota", *args, "--config", str(device)], capture_output=True, text=True,
                       timeout=900, env=env_for_bench())
    if p.returncode != 0:
        raise SystemExit(f"edge ota {' '.join(args)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout) if p.stdout.strip().startswith("{") else {"stdout": p.stdout}


def build(folder: Path, key: Path, model: Path, version: str, revision: int, base: Path | None) -> Path:
    cfg = folder / f"config-{version}.toml"
    cfg.write_text(config(folder, model, revision))
    out = folder / f"{version}{'-thin' if base else ''}.edgeb"
    args = ["build", "--version", version, "--key", str(key), "--config", str(cfg), "--model", str(model),
            "-o", str(out)] + (["--base", str(base)] if base else [])
    subprocess.run([*EDGE, "ota", *args], check=True, capture_output=True, timeout=900, env=env_for_bench())
    return out


def disk(root: Path) -> dict[str, int]:
    """Blocks used under `root`, each inode once; and what every version's own copy would use."""
    seen: set[tuple[int, int]] = set()
    used = copies = 0
    for p in root.rglob("*"):
        st = p.lstat()
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            used += st.st_blocks * 512
        if p.is_file() and not p.is_symlink() and "versions" in p.relative_to(root).parts:
            copies += st.st_size
    return {"used_bytes": used, "copy_layout_bytes": copies}


def activation(pid1: PidOne, device: Path, thin: Path, pub: Path, svc_state: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    body = json.dumps(REQUEST).encode()
    load = TimedLoad(pid1.address, body, clients=args.clients, max_seconds=args.seconds * 3 + 900,
                     check=correct).start()
    load.wait_ok(args.clients * 2)
    t0 = time.monotonic()
    time.sleep(args.seconds)  # steady window: the baseline from the same minutes
    w0 = time.monotonic()
    answer = edge_ota(device, "install", str(thin), "--pubkey", str(pub), "--reload", "--timeout", "600")
    report: dict[str, Any] = {}
    while time.monotonic() - w0 < 120:  # the old set drained: the report's last write
        report = json.loads((svc_state / "last-reload.json").read_text())
        if report.get("drain_s") is not None:
            break
        time.sleep(0.05)
    w1 = time.monotonic()
    time.sleep(args.seconds / 2)
    r = load.stop()
    steady = [b - a for a, b in load.spans if a >= t0 and b <= w0]
    during = in_windows(load.spans, [(w0, w1)])
    phases = [p["name"] for p in report.get("phases", [])]
    return {
        "install": {k: answer.get(k) for k in ("result", "version", "reload", "written_bytes", "reused_bytes")},
        "reload_report": {"kept": report.get("kept"), "loaded": report.get("loaded"), "mode": report.get("mode"),
                          "switch_s": report.get("switch_s"), "drain_s": report.get("drain_s"), "phases": phases},
        "model_kept": report.get("kept") == ["gemma"] and not report.get("loaded"),
        "page_in_or_load_phases": [p for p in phases if p in ("page_in", "model_load", "validate")],
        "activation_window_s": round(w1 - w0, 3),
        "steady": {"requests": len(steady), "p99_s": round(percentile(steady, 0.99), 4)},
        "during_activation": {"requests": len(during), "max_s": round(max(during, default=0.0), 4),
                              "p99_s": round(percentile(during, 0.99), 4)},
        "all_requests": stats(r, time.monotonic() - t0),
    }


def _evict(path: Path) -> None:
    """Drop this one file's pages from the page cache (clean pages: nothing is written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env_for_bench())
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return time.monotonic() - t0, p.stdout


def recheck_cost(device: Path, ota_root: Path, newer: Path, pub: Path, rounds: int) -> dict[str, Any]:
    """Rollback (to the version before) and the install of the newer one again: each re-hashes the
    model; `sha256sum` of the same object in the same cache state, the order alternating."""
    model = next((ota_root / "objects" / "sha256").iterdir(), None)
    assert model is not None and model.stat().st_size > 1 << 20, "no model object in the store"
    steps = {"rollback": [*EDGE, "ota", "rollback", "--no-activate", "--pubkey", str(pub), "--config", str(device)],
             "install_on_disk": [*EDGE, "ota", "install", str(newer), "--pubkey", str(pub), "--no-activate",
                                 "--config", str(device)],
             "sha256sum": ["sha256sum", str(model)]}
    found: dict[str, dict[str, list[float]]] = {c: {k: [] for k in steps} for c in ("warm", "cold")}
    checked: dict[str, dict[str, list[float]]] = {c: {"rollback": [], "install_on_disk": []} for c in found}
    for i in range(rounds):
        for cache in ("warm", "cold"):
            pairs = [("rollback", "sha256sum"), ("install_on_disk", "sha256sum")]
            for edge_step, peer in pairs:
                for name in ((edge_step, peer) if i % 2 == 0 else (peer, edge_step)):
                    if cache == "cold":
                        _evict(model)
                    else:
                        _timed(["sha256sum", str(model)])  # in the page cache, whatever ran before
                    wall, out = _timed(steps[name])
                    found[cache][name].append(wall)
                    if name != "sha256sum":
                        checked[cache][name].append(json.loads(out)["checked"]["seconds"])
                if edge_step == "install_on_disk":
                    edge_ota(device, "commit")
    med = statistics.median
    result: dict[str, Any] = {"model_bytes": model.stat().st_size, "rounds": rounds}
    for cache in found:
        peer = med(found[cache]["sha256sum"])
        result[cache] = {
            "sha256sum_wall_s": round(peer, 3),
            **{f"{k}_checked_s": round(med(v), 3) for k, v in checked[cache].items()},
            **{f"{k}_wall_s": round(med(found[cache][k]), 3) for k in ("rollback", "install_on_disk")},
            "rollback_checked_to_sha256sum": round(med(checked[cache]["rollback"]) / peer, 2)}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: the embedded Gemma (builtin:gemma3-270m)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0, help="steady window before the activation")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the re-check measurement (4.)")
    args = ap.parse_args()
    load_start = load_average()
    model = args.model or gemma_path()
    folder = Path(tempfile.mkdtemp(prefix="edge-ota-bench-"))
    key = folder / "signing.key"
    subprocess.run([*EDGE, "ota", "keygen", "-o", str(key)], check=True, capture_output=True, env=env_for_bench())
    pub = folder / "signing.key.pub"
    device = folder / "device.toml"
    device.write_text(f'[paths]\nstate_dir = "{folder / "device"}"\n[[models]]\nname = "x"\npath = "/x.gguf"\n')
    full = {v: build(folder, key, model, v, i, None) for i, v in enumerate(("1.0.0", "1.1.0"))}
    thin = {"1.1.0": build(folder, key, model, "1.1.0", 1, full["1.0.0"])}
    thin["1.2.0"] = build(folder, key, model, "1.2.0", 2, full["1.0.0"])
    thin["1.3.0"] = build(folder, key, model, "1.3.0", 3, full["1.0.0"])
    result: dict[str, Any] = {"model": str(model), "model_bytes": model.stat().st_size, "load_average_start": load_start}
    result["config_only_update_bytes"] = {"full": full["1.1.0"].stat().st_size, "thin": thin["1.1.0"].stat().st_size}
    result["config_only_update_bytes"]["ratio_thin_to_full"] = round(
        thin["1.1.0"].stat().st_size / full["1.1.0"].stat().st_size, 6)
    for bundle in (full["1.0.0"], thin["1.1.0"], thin["1.2.0"]):
        edge_ota(device, "install", str(bundle), "--pubkey", str(pub), "--no-activate", "--keep", "3")
        edge_ota(device, "commit")
    ota_root = folder / "device" / "ota"
    d = disk(ota_root)
    result["three_versions_disk"] = {**d, "versions": sorted(p.name for p in (ota_root / "versions").iterdir()),
                                     "ratio_after_to_before": round(d["used_bytes"] / d["copy_layout_bytes"], 4)}
    with PidOne([*EDGE, "serve", "--config", str(ota_root / "current" / "edge.toml")], env=env_for_bench()) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=600)
        result["reload_after_config_only_ota"] = activation(pid1, device, thin["1.3.0"], pub,
                                                            folder / "svc-state", args)
        pid1.stop()
    act = result["reload_after_config_only_ota"]
    act["worst_during_vs_steady_p99"] = round(act["during_activation"]["max_s"] / max(act["steady"]["p99_s"], 1e-9), 2)
    result["recheck_before_switch"] = recheck_cost(device, ota_root, thin["1.3.0"], pub, args.rounds)
    result["load_average_end"] = load_average()
    emit(result, "ota")
    print(f"load average {load_start} -> {result['load_average_end']}; config-only update "
          f"{result['config_only_update_bytes']['full']} B full, {result['config_only_update_bytes']['thin']} B thin; "
          f"3 versions {d['copy_layout_bytes']} B as copies, {d['used_bytes']} B in the store; reload kept the "
          f"model: {act['model_kept']}; worst during activation {act['during_activation']['max_s']} s vs "
          f"steady p99 {act['steady']['p99_s']} s", file=sys.stderr)
    rc = result["recheck_before_switch"]
    print("check before a switch (median of %d; s)   checked by edge   wall: rollback  install on disk  sha256sum"
          % rc["rounds"], file=sys.stderr)
    for cache in ("warm", "cold"):
        r = rc[cache]
        print(f"  {cache:<5} {r['rollback_checked_s']:>8} / {r['install_on_disk_checked_s']:<8}"
              f"{r['rollback_wall_s']:>22} {r['install_on_disk_wall_s']:>16} {r['sha256sum_wall_s']:>10}"
              f"   (rollback's check / sha256sum: {r['rollback_checked_to_sha256sum']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
