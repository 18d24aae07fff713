"""What is installed against what runs (edge.lifecycle.installed): the reasons `edge reload` hands
the service over to a new process."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import llama_cpp  # noqa: F401 - its libraries are what this process has mapped

from edge.lifecycle.installed import Running, installed_version, mapped_libraries, unit_environment


def test_a_changed_version_on_disk_is_a_difference(tmp_path: Path) -> None:
    pkg = tmp_path / "edge"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""doc"""\n__version__ = "1.2.3"\n')
    running = Running("1.2.3", pkg, {"A": "1"}, "inv")
    assert running.differences() == []
    (pkg / "__init__.py").write_text('__version__ = "1.2.4"\n')
    assert installed_version(pkg) == "1.2.4"
    assert running.differences() == [f"edge 1.2.4 is installed ({pkg}), 1.2.3 runs"]


def test_a_replaced_llama_library_is_a_difference(tmp_path: Path) -> None:
    lib = next(p for p in mapped_libraries() if "(deleted)" not in p)
    copy = tmp_path / Path(lib).name
    shutil.copy(lib, copy)
    ctypes.CDLL(str(copy))  # mapped now, as llama_cpp maps its own
    running = Running("0", tmp_path, {}, None)
    assert not any(str(copy) in why for why in running.differences())
    shutil.copy(lib, tmp_path / "new.so")
    (tmp_path / "new.so").replace(copy)  # what an update does: a new file (a new inode) at the same path
    assert f"llama.cpp: {copy} was replaced since it was loaded" in running.differences()


def test_the_unit_environment_counts_only_within_one_invocation(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('__version__ = "0"\n')
    running = Running("0", tmp_path, unit_environment({"A": "1", "LISTEN_FDS": "1", "INVOCATION_ID": "x"}), "x")
    same = {"A": "1", "INVOCATION_ID": "x", "NOTIFY_SOCKET": "/run/n", "JOURNAL_STREAM": "8:9"}
    def env_reasons(client: dict[str, str]) -> list[str]:  # (a library test may have left one replaced)
        return [w for w in running.differences(client) if not w.startswith("llama.cpp")]

    assert env_reasons(same) == []
    assert env_reasons({**same, "A": "2", "B": "3"}) == ["the unit's environment changed: A, B"]
    assert env_reasons({"A": "2", "INVOCATION_ID": "y"}) == []  # a shell's, or another invocation's
    assert running.successor_environment({**same, "A": "2"}) == {"A": "2"}
    assert running.successor_environment({"A": "2", "INVOCATION_ID": "y"}) == {"A": "1"}


def test_a_library_rewritten_at_its_path_is_a_difference_once_noted(tmp_path: Path) -> None:
    lib = next(p for p in mapped_libraries() if "(deleted)" not in p)
    copy = tmp_path / Path(lib).name
    shutil.copy(lib, copy)
    ctypes.CDLL(str(copy))
    running = Running("0", tmp_path, {}, None)
    running.note_libraries()  # as a start does once its models are loaded
    assert str(copy) in running.libraries and not any(str(copy) in why for why in running.differences())
    with open(copy, "ab") as f:  # written in place: the same inode, another size and mtime
        f.write(b"\0" * 16)
    assert f"llama.cpp: {copy} was replaced since it was loaded" in running.differences()


def test_maps_naming_another_device_than_stat_is_no_difference(tmp_path: Path, monkeypatch) -> None:
    """On overlayfs (a container) /proc/self/maps gives the layer's device and inode, stat() the
    overlay's: a library that did not change must not make every reload a handover. The maps
    reading is replaced here (a test double of the kernel's file) by one with another device."""
    import edge.lifecycle.installed as installed

    running = Running("0", tmp_path, {}, None)
    running.note_libraries()
    real = installed.mapped_libraries()
    assert real, "llama_cpp's libraries are mapped in the test process"
    monkeypatch.setattr(installed, "mapped_libraries", lambda: {p: (dev + 1, ino + 7) for p, (dev, ino) in real.items()})
    noted = set(running.libraries)
    assert noted and not [why for why in running.differences() if any(f"{p} was replaced" in why for p in noted)]


def test_a_model_file_is_mapped_by_its_path_as_well_as_by_its_inode(tmp_path: Path) -> None:
    import mmap

    from edge.lifecycle.installed import mapped_files

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 8192)
    with open(model, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as _:
        mapped = mapped_files()
        st = model.stat()
        assert (st.st_dev, st.st_ino) in mapped and str(model) in mapped
    assert str(model) not in mapped_files()
