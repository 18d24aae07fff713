import json
import os
from pathlib import Path

import pytest

from edge.errors import EX_DATAERR, ModelError
from edge.model.gguf import GGML_BLOCKS, read_gguf_info
from edge.model.mlock import MlockStatus, vm_locked_bytes


def test_valid_file_yields_its_metadata(tiny_gguf: Path) -> None:
    info = read_gguf_info(tiny_gguf)
    assert info.architecture == "llama"
    assert info.tensor_count == 21
    assert info.metadata["n_vocab"] == 269
    assert info.context_length == 512
    assert info.chat_template and "messages" in info.chat_template
    assert info.data_offset % 32 == 0
    assert info.data_offset + info.data_bytes == os.path.getsize(tiny_gguf)


def test_block_table_matches_the_gguf_package() -> None:
    gguf = pytest.importorskip("gguf")
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        # Q8_1 is never stored in files; gguf-py lists its old 40-byte layout, ggml's is 36.
        if int(qtype) in GGML_BLOCKS and qtype.name != "Q8_1":
            assert GGML_BLOCKS[int(qtype)] == (block, size), qtype.name


def _bad(path: Path) -> ModelError:
    with pytest.raises(ModelError) as info:
        read_gguf_info(path)
    assert info.value.exit_code == EX_DATAERR
    assert str(path) in str(info.value)
    return info.value


@pytest.mark.parametrize("keep", [10, 100, 3000, -1000, -8])
def test_truncated_files_are_refused_with_offsets(tmp_path: Path, tiny_gguf: Path, keep: int) -> None:
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:keep] if keep > 0 else data[:keep])
    e = _bad(bad)
    assert "truncated" in str(e) or "shorter than a GGUF header" in str(e)


def test_random_bytes_named_gguf_are_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "random.gguf"
    bad.write_bytes(os.urandom(4096))
    assert "not a GGUF file: expected magic b'GGUF'" in str(_bad(bad))


def test_missing_file_directory_and_bad_version(tmp_path: Path, tiny_gguf: Path) -> None:
    assert "does not exist" in str(_bad(tmp_path / "nope.gguf"))
    assert "directory" in str(_bad(tmp_path))
    data = bytearray(tiny_gguf.read_bytes())
    data[4:8] = (9).to_bytes(4, "little")
    v9 = tmp_path / "v9.gguf"
    v9.write_bytes(bytes(data))
    assert "unsupported GGUF version 9" in str(_bad(v9))


def test_corrupt_metadata_type_is_named(tmp_path: Path, tiny_gguf: Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    # first metadata entry: after the 24-byte header come key length (8), key, then value type
    key_len = int.from_bytes(data[24:32], "little")
    data[32 + key_len:36 + key_len] = (77).to_bytes(4, "little")
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(data))
    assert "unknown type 77" in str(_bad(bad))


def test_mlock_status_explains_the_fix() -> None:
    bad = MlockStatus(requested=True, locked_bytes=0, expected_bytes=100 << 20,
                      limit_bytes=8 << 20, cap_ipc_lock=False)
    assert not bad.ok
    assert "LimitMEMLOCK=infinity" in bad.explain() and "ulimit -l" in bad.explain()
    assert "8.0 MiB" in bad.explain()
    good = MlockStatus(requested=True, locked_bytes=100 << 20, expected_bytes=100 << 20,
                       limit_bytes=None, cap_ipc_lock=True)
    assert good.ok and "mlock ok" in good.explain()
    assert MlockStatus(False, 0, 100, None, False).ok


def test_vm_locked_bytes_sees_a_lock_taken_and_released() -> None:
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 2 * page)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    before = vm_locked_bytes()
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(2 * page)) != 0:
        pytest.skip(f"mlock of two pages refused here (errno {ctypes.get_errno()})")
    try:
        assert vm_locked_bytes() - before == 2 * page
    finally:
        libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(2 * page))
    assert vm_locked_bytes() == before


def test_what_must_be_locked_depends_on_mmap_and_offload(tiny_gguf: Path) -> None:
    from edge.model.mlock import mlock_status

    info = read_gguf_info(tiny_gguf)
    mapped = mlock_status(True, info.data_bytes, info, use_mmap=True, n_gpu_layers=0)
    assert mapped.ok and mapped.expected_bytes == info.data_bytes
    assert not mlock_status(True, info.data_bytes // 2, info, use_mmap=True, n_gpu_layers=0).ok
    assert mlock_status(True, int(info.data_bytes * 0.93), info, use_mmap=False, n_gpu_layers=0).ok
    # all layers offloaded: the mapping is locked from its start to the end of the token
    # embeddings, the only CPU-resident tensor (stored first here), page-rounded
    embd = next(t for t in info.tensors if t.name == "token_embd.weight")
    page = __import__("os").sysconf("SC_PAGE_SIZE")
    locked = -(-(info.data_offset + embd.offset + embd.nbytes) // page) * page
    offloaded = mlock_status(True, locked, info, use_mmap=True, n_gpu_layers=-1)
    assert offloaded.ok and offloaded.expected_bytes == locked
    assert not mlock_status(True, 4096, info, use_mmap=True, n_gpu_layers=-1).ok  # one page is not a lock


def test_unmapped_load_locks_its_cpu_buffers(tmp_path: Path, tiny_gguf: Path) -> None:
    from edge.config import ModelConfig
    from edge.model.llm import load_gguf_model

    m = load_gguf_model(ModelConfig(name="t", path=str(tiny_gguf), n_ctx=128, use_mmap=False),
                        read_gguf_info(tiny_gguf))
    assert m.mlock.ok, m.mlock.as_dict()


def test_a_header_is_validated_once_per_file_identity(tmp_path: Path, tiny_gguf: Path) -> None:
    """edge.model.file.VerifiedCache keeps what validation found beside the file's identity (with
    its ctime): the next start takes it from there; any change to the file validates it again."""
    import shutil

    from edge.config import ModelConfig
    from edge.model.file import ModelFile, VerifiedCache

    model = tmp_path / "m.gguf"
    shutil.copyfile(tiny_gguf, model)
    cache = tmp_path / "verified.json"
    cfg = ModelConfig(name="m", path=str(model))

    first = ModelFile(cfg, VerifiedCache(cache))
    info = first.validate()
    assert first.validated_earlier is False
    again = ModelFile(cfg, VerifiedCache(cache))  # a later start: the cache read from disk
    assert again.validate() == info and again.validated_earlier is True

    # the same bytes rewritten in place: mtime set back, but the ctime moved: validated again
    st = model.stat()
    model.write_bytes(model.read_bytes())
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = ModelFile(cfg, VerifiedCache(cache))
    assert third.validate() == info and third.validated_earlier is False

    # a file cut short after it was validated: its identity changed, the cut is found
    model.write_bytes(tiny_gguf.read_bytes()[:5000])
    with pytest.raises(ModelError, match="truncated"):
        ModelFile(cfg, VerifiedCache(cache)).validate()

    # a damaged entry is read as none: validated again, never trusted
    model.write_bytes(tiny_gguf.read_bytes())
    ModelFile(cfg, VerifiedCache(cache)).validate()
    raw = json.loads(cache.read_text())
    raw[str(model)]["gguf"]["info"]["tensors"] = "not a table"
    cache.write_text(json.dumps(raw))
    fourth = ModelFile(cfg, VerifiedCache(cache))
    assert fourth.validate() == info and fourth.validated_earlier is False


def test_a_verified_sha256_and_a_validated_header_share_the_entry(tmp_path: Path, tiny_gguf: Path) -> None:
    import hashlib

    from edge.model.file import VerifiedCache

    cache = VerifiedCache(tmp_path / "verified.json")
    cache.remember_header(tiny_gguf, read_gguf_info(tiny_gguf))
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert not cache.is_verified(tiny_gguf, digest)  # a header alone verifies no sha256
    cache.remember(tiny_gguf, digest)
    later = VerifiedCache(tmp_path / "verified.json")
    assert later.is_verified(tiny_gguf, digest) and later.header(tiny_gguf) == read_gguf_info(tiny_gguf)


def test_the_verified_cache_forgets_files_that_are_gone(tmp_path: Path, tiny_gguf: Path) -> None:
    """An OTA version pruned or a model replaced under another name: its entry goes at the next
    write, so verified.json holds the device's files, not every path it ever served."""
    import json
    import shutil

    from edge.config import ModelConfig
    from edge.model.file import ModelFile, VerifiedCache

    cache = tmp_path / "verified.json"
    old, new = tmp_path / "v1.gguf", tmp_path / "v2.gguf"
    shutil.copyfile(tiny_gguf, old)
    shutil.copyfile(tiny_gguf, new)
    ModelFile(ModelConfig(name="m", path=str(old)), VerifiedCache(cache)).validate()
    assert set(json.loads(cache.read_text())) == {str(old)}
    old.unlink()
    ModelFile(ModelConfig(name="m", path=str(new)), VerifiedCache(cache)).validate()
    assert set(json.loads(cache.read_text())) == {str(new)}
