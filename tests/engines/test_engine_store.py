"""The engine store: keys, atomic writes, mismatch messages, checksum refusal, gc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge.engines import store as store_mod
from edge.engines.key import EngineKey
from edge.engines.store import EngineStore
from edge.errors import EngineError

SHA = "ab" * 32


def trt_key(**kw) -> EngineKey:
    base = dict(model="det", model_sha256=SHA, backend="tensorrt", target="sm_87", precision="fp16",
                cuda="12.6", tensorrt="10.3.0")
    return EngineKey(**{**base, **kw})


def put(st: EngineStore, key: EngineKey, data: bytes = b"plan-bytes") -> Path:
    tmp = st.tmp_path(key)
    tmp.write_bytes(data)
    return st.put(key, tmp, {"flags": {"x": 1}}).path


def test_layout_follows_the_design(tmp_path: Path) -> None:
    st = EngineStore(tmp_path)
    p = put(st, trt_key(profile="batch8"))
    assert p == tmp_path / "det" / SHA[:16] / "sm_87-cuda12.6-trt10.3.0-fp16-batch8.engine"
    ort = EngineKey(model="det", model_sha256=SHA, backend="onnxruntime", target="cpu-aarch64",
                    precision="fp32", onnxruntime="1.20.1")
    assert ort.filename() == "cpu-aarch64-ort1.20.1-fp32.ort"
    (e,) = st.entries()
    assert e.meta["sha256"] == e.sha256 and e.meta["builder_host"] and e.meta["created"]
    assert e.meta["build"] == {"flags": {"x": 1}} and e.key == trt_key(profile="batch8")


def test_find_exact_and_mismatch_names_the_field(tmp_path: Path) -> None:
    st = EngineStore(tmp_path)
    put(st, trt_key(target="sm_72"))
    with pytest.raises(EngineError) as info:
        st.find(trt_key())
    msg = str(info.value)
    assert "engine was built for sm_72, this device is sm_87" in msg
    assert "sm_72-cuda12.6-trt10.3.0-fp16.engine" in msg  # lists what the store holds
    put(st, trt_key())
    assert st.find(trt_key()).key == trt_key()
    with pytest.raises(EngineError, match="built for tensorrt 10.3.0, this device is tensorrt 10.4.0"):
        st.find(trt_key(target="sm_72", tensorrt="10.4.0"))
    with pytest.raises(EngineError, match="no engine for model 'det' with sha256 cdcdcd"):
        st.find(trt_key(model_sha256="cd" * 32))
    with pytest.raises(EngineError, match="precision fp16, this device needs precision int8"):
        st.find(trt_key(precision="int8"))


def test_corrupt_engine_is_refused(tmp_path: Path) -> None:
    st = EngineStore(tmp_path)
    p = put(st, trt_key())
    e = st.find(trt_key())
    st.verify(e)
    p.write_bytes(b"plan-bytez")
    with pytest.raises(EngineError, match="sha256 mismatch.*will not be deserialized"):
        st.verify(st.find(trt_key()))
    p.unlink()
    with pytest.raises(EngineError, match="missing"):
        st.verify(e)


def test_replacing_an_engine_never_shows_a_stale_entry(tmp_path: Path, monkeypatch) -> None:
    st = EngineStore(tmp_path)
    put(st, trt_key(), b"old")
    real_replace = os.replace
    calls = []

    def crash_on_engine_rename(src, dst):
        calls.append(str(dst))
        if str(dst).endswith(".engine"):
            raise OSError("simulated crash between manifest update and rename")
        return real_replace(src, dst)

    monkeypatch.setattr(store_mod.os, "replace", crash_on_engine_rename)
    with pytest.raises(OSError):
        put(st, trt_key(), b"new")
    monkeypatch.setattr(store_mod.os, "replace", real_replace)
    # the old entry went first: no entry points at a file it does not describe
    assert st.entries() == []
    put(st, trt_key(), b"new")
    st.verify(st.find(trt_key()))


WRITER = """
import sys, time
from pathlib import Path
from edge.engines.key import EngineKey
from edge.engines.store import EngineStore
key = EngineKey(model="det", model_sha256="ab" * 32, backend="tensorrt", target="sm_87",
                precision="fp16", cuda="12.6", tensorrt="10.3.0")
st = EngineStore(sys.argv[1])
with open(st.tmp_path(key), "wb") as f:  # what a build does: write the plan under a hidden name
    for _ in range(10_000):
        f.write(b"x" * 65536)
        f.flush()
        print("writing", flush=True)
        time.sleep(0.01)
"""


def test_kill_during_write_leaves_no_visible_engine(tmp_path: Path, monkeypatch) -> None:
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE)
    for _ in range(5):
        p.stdout.readline()
    p.send_signal(signal.SIGKILL)
    p.wait()
    st = EngineStore(tmp_path)
    assert st.entries() == []
    with pytest.raises(EngineError, match="no engine for model"):
        st.find(trt_key())
    strays = list(tmp_path.rglob("*.building"))
    assert len(strays) == 1 and strays[0].stat().st_size > 0
    monkeypatch.setattr(store_mod, "STRAY_AGE_S", 0)
    time.sleep(0.01)
    st.gc(keep=1, in_use=set())
    assert not list(tmp_path.rglob("*.building"))


def test_gc_keeps_newest_and_in_use(tmp_path: Path) -> None:
    st = EngineStore(tmp_path)
    paths = []
    for i, sm in enumerate(("sm_53", "sm_72", "sm_87")):
        paths.append(put(st, trt_key(target=sm), f"p{i}".encode()))
        time.sleep(1.05)  # 'created' has one-second resolution
    removed = st.gc(keep=1, in_use={str(paths[0])})
    assert [e.path for e in removed] == [paths[1]]
    assert sorted(e.key.target for e in st.entries()) == ["sm_53", "sm_87"]
    assert not paths[1].exists()


def test_rekey_gives_a_board_keyed_engine_its_module_key_in_place(tmp_path: Path) -> None:
    st = EngineStore(tmp_path)
    old = trt_key(platform="jetson-agx-orin", host="jetson")
    path = put(st, old)
    (e,) = st.entries()
    new = st.rekey(e, e.key.rekeyed("jetson-p3701-0005"))
    assert not path.exists() and new.path.read_bytes() == b"plan-bytes"
    assert new.path.name == "sm_87-jetson-p3701-0005-cuda12.6-trt10.3.0-fp16.engine"
    (listed,) = st.entries()  # one entry: the old one is gone from the manifest
    assert listed.key == new.key and listed.key.board == "jetson-agx-orin"
    assert listed.meta["rekeyed_from"]["platform"] == "jetson-agx-orin"
    st.verify(listed)
    bad = put(st, trt_key(platform="jetson-xavier-nx", host="jetson"), b"plan")
    bad.write_bytes(b"corrupt")
    corrupt = next(x for x in st.entries() if x.key.platform == "jetson-xavier-nx")
    with pytest.raises(EngineError, match="sha256 mismatch"):
        st.rekey(corrupt, corrupt.key.rekeyed("jetson-p3668-0001"))
    assert bad.exists()  # a corrupt engine keeps its name


def test_rekey_on_a_machine_that_is_no_jetson_says_so(tmp_path: Path) -> None:
    from kit import EDGE

    r = subprocess.run([*EDGE, "engines", "rekey", "--store", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 70 and "edge engines rekey runs on a Jetson whose device tree names its module" in r.stderr
    assert "Traceback" not in r.stderr
