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
