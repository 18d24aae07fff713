"""GGUF model files: header validation before llama.cpp sees them.

llama.cpp aborts or crashes on some malformed files; edge reads the header, every metadata
entry and every tensor record itself first, and checks that the data the tensors claim lies
inside the file. A truncated or foreign file is a ModelError that names the file and what was
expected, never a crash.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.errors import ModelError

__all__ = ["GGUFInfo", "OffloadSplit", "TensorRecord", "offload_split", "read_gguf_info", "GGML_BLOCKS"]

INFO_FORMAT = 1  # of GGUFInfo.as_json(): a stored header of another format is read again

MAGIC = b"GGUF"
MAX_COUNT = 1 << 24  # more tensors or metadata entries than this means a corrupt header

# ggml tensor type -> (elements per block, bytes per block)
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66),
    39: (32, 17),
}

# metadata value type -> struct format (scalars); 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_KEEP_ARRAYS = {"tokenizer.ggml.tokens": "n_vocab"}  # arrays kept under another name (a count)
MAX_TOKEN_BYTES = "edge.max_token_bytes"  # derived while skipping the vocabulary


@dataclass(frozen=True)
class TensorRecord:
    name: str
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFInfo:
    path: str
    size: int
    version: int
    tensor_count: int
    data_offset: int
    data_bytes: int
    metadata: dict[str, Any] = field(repr=False)
    tensors: tuple[TensorRecord, ...] = field(default=(), repr=False)

    @property
    def block_count(self) -> int:
        v = self.metadata.get(f"{self.architecture}.block_count")
        return int(v) if isinstance(v, int) and v > 0 else 0

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    @property
    def context_length(self) -> int | None:
        v = self.metadata.get(f"{self.architecture}.context_length")
        return int(v) if v is not None else None

    @property
    def max_token_bytes(self) -> int | None:
        """The longest vocabulary entry in bytes: no token stands for more text than this."""
        v = self.metadata.get(MAX_TOKEN_BYTES)
        return int(v) if v is not None else None

    @property
    def chat_template(self) -> str | None:
        v = self.metadata.get("tokenizer.chat_template")
        return v if isinstance(v, str) else None

    def as_json(self) -> dict[str, Any]:
        """What validation found, to keep beside the file's identity (edge.model.file.VerifiedCache)."""
        return {"format": INFO_FORMAT, "size": self.size, "version": self.version,
                "tensor_count": self.tensor_count, "data_offset": self.data_offset, "data_bytes": self.data_bytes,
                "metadata": self.metadata, "tensors": [[t.name, t.offset, t.nbytes] for t in self.tensors]}

    @staticmethod
    def from_json(path: str, raw: Any) -> GGUFInfo | None:
        """`as_json()`'s dict back, or None where it is not one (another format, damaged)."""
        try:
            if raw["format"] != INFO_FORMAT or not isinstance(raw["metadata"], dict):
                return None
            return GGUFInfo(path=path, size=int(raw["size"]), version=int(raw["version"]),
                            tensor_count=int(raw["tensor_count"]), data_offset=int(raw["data_offset"]),
                            data_bytes=int(raw["data_bytes"]), metadata=raw["metadata"],
                            tensors=tuple(TensorRecord(str(n), int(o), int(b)) for n, o, b in raw["tensors"]))
        except (KeyError, TypeError, ValueError):
            return None

    def summary(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "name": self.metadata.get("general.name"),
                "gguf_version": self.version, "tensors": self.tensor_count, "bytes": self.size,
                "context_length": self.context_length, "n_vocab": self.metadata.get("n_vocab")}


class _Reader:
    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path
        self.longest_token: int | None = None

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ModelError(self.path, f"truncated GGUF header: needed {size} bytes at offset "
                                        f"{self.pos}, file has {len(self.buf)} bytes")
        (val,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return val

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ModelError(self.path, f"truncated GGUF header: string of {n} bytes at offset "
                                        f"{self.pos} runs past the end of the file ({len(self.buf)} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(self.path, f"corrupt GGUF header: string at offset {self.pos - n} "
                                        "is not UTF-8") from None

    def _skip_strings(self, count: int, key: str) -> int:
        # Vocabularies hold ~10^5 strings: skip them by their lengths alone, without decoding.
        # Returns the longest (for the vocabulary: a bound on the bytes one token stands for).
        buf, pos, size, unpack, longest = self.buf, self.pos, len(self.buf), struct.unpack_from, 0
        for _ in range(count):
            if pos + 8 > size:
                pos = size + 1
                break
            n = unpack("<Q", buf, pos)[0]
            longest = n if n > longest else longest
            pos += 8 + n
        if pos > size:
            raise ModelError(self.path, f"truncated GGUF header: array {key!r} runs past the end "
                                        f"of the file ({size} bytes)")
        self.pos = pos
        return longest

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.unpack("I"), self.unpack("Q")
            if count > len(self.buf):
                raise ModelError(self.path, f"corrupt GGUF header: array {key!r} claims {count} items")
            if etype in _SCALARS and key not in _KEEP_ARRAYS:
                self.pos += struct.calcsize("<" + _SCALARS[etype]) * count  # skipped, not needed
                if self.pos > len(self.buf):
                    raise ModelError(self.path, f"truncated GGUF header: array {key!r} runs past the end")
                return count
            if etype == 8:
                longest = self._skip_strings(count, key)
                if key == "tokenizer.ggml.tokens":
                    self.longest_token = longest
                return count
            for _ in range(count):
                self.value(etype, key)
            return count
        raise ModelError(self.path, f"corrupt GGUF header: metadata {key!r} has unknown type {vtype}")


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """Validate a GGUF file's header and tensor table; raise ModelError naming what is wrong."""
    p = str(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        raise ModelError(p, "model file does not exist") from None
    except OSError as exc:
        raise ModelError(p, f"cannot open model file: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(p, "expected a GGUF file, found a directory or special file")
        size = st.st_size
        if size < 24:
            raise ModelError(p, f"not a GGUF file: {size} bytes is shorter than a GGUF header (24)")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as buf:
            return _parse(_Reader(buf, p), size)
    finally:
        os.close(fd)


def _parse(r: _Reader, size: int) -> GGUFInfo:
    magic = bytes(r.buf[:4])
    if magic != MAGIC:
        raise ModelError(r.path, f"not a GGUF file: expected magic {MAGIC!r}, found {magic!r}")
    r.pos = 4
    version, n_tensors, n_kv = r.unpack("I"), r.unpack("Q"), r.unpack("Q")
    if version not in (2, 3):
        raise ModelError(r.path, f"unsupported GGUF version {version}: expected 2 or 3")
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
        raise ModelError(r.path, f"corrupt GGUF header: {n_tensors} tensors, {n_kv} metadata entries")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        val = r.value(r.unpack("I"), key)
        meta[_KEEP_ARRAYS.get(key, key)] = val
    ends, tensors = [], []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.unpack("I")
        if n_dims > 8:
            raise ModelError(r.path, f"corrupt GGUF tensor {name!r}: {n_dims} dimensions")
        n_elems = 1
        for _ in range(n_dims):
            n_elems *= r.unpack("Q")
        ttype, offset = r.unpack("I"), r.unpack("Q")
        block = GGML_BLOCKS.get(ttype)
        nbytes = (n_elems // block[0]) * block[1] if block else 0
        ends.append((offset + nbytes, name))
        tensors.append(TensorRecord(name, offset, nbytes))
    if r.longest_token is not None:
        meta[MAX_TOKEN_BYTES] = r.longest_token
    align = int(meta.get("general.alignment", 32)) or 32
    data_offset = (r.pos + align - 1) // align * align
    end, name = max(ends, default=(0, ""))
    if data_offset + end > size:
        raise ModelError(r.path, f"truncated GGUF file: tensor {name!r} ends at byte "
                                 f"{data_offset + end}, file has {size} bytes")
    return GGUFInfo(path=r.path, size=size, version=version, tensor_count=n_tensors,
                    data_offset=data_offset, data_bytes=end, metadata=meta, tensors=tuple(tensors))


@dataclass(frozen=True)
class OffloadSplit:
    """Where llama.cpp puts a model's weights for one n_gpu_layers: bytes in CPU buffers, bytes
    copied to the GPU, bytes held twice (tied embeddings: a model without output.weight uses
    token_embd for the output layer, and llama.cpp loads it a second time into the output
    layer's buffer when that buffer is on the GPU), and what mlock locks of a mapped file:
    llama.cpp grows one lock from the mapping's start to the end of each CPU-resident tensor it
    places in the mapping (llama_model_loader::load_all_data: `lmlock->grow_to(offs + size)`), so
    the range from byte 0 to the end of the last CPU-resident tensor, offloaded tensors stored
    before it included."""

    cpu: int
    gpu: int
    duplicated: int
    gpu_layers: int  # repeating layers on the GPU
    output_on_gpu: bool
    locked: int = 0  # file bytes [0, end of the last CPU-resident tensor): what mlock locks with mmap


def _layer(name: str, n_layer: int) -> int | None:
    """Which of llama.cpp's layer slots a tensor belongs to: None = the input layer (always on the
    CPU), 0..n_layer-1 = a repeating block, n_layer = the output layer. Unnumbered repeating
    tensors (token_embd_norm, rope_freqs) go with the first block, as llama.cpp places them."""
    if name.startswith("blk."):
        num = name.split(".")[1]
        return int(num) if num.isdigit() else 0
    if name.split(".")[0] in ("token_embd", "position_embd", "token_types"):
        return None
    if name.startswith(("output", "cls")):
        return n_layer
    return 0


def offload_split(info: GGUFInfo, n_gpu_layers: int, output_first: bool | None = True) -> OffloadSplit:
    """llama.cpp's placement (src/llama-model.cpp, load_tensors): there are n_layer + 1 slots
    (the blocks and the output layer); the input layer (token embeddings) always stays on the CPU.
    Since ggml-org/llama.cpp#18148 (December 2025, `output_first`) n_gpu_layers = k puts the output
    layer on the GPU first, then the last k - 1 blocks; before it, the last k blocks, and the output
    layer only when k > n_layer. A negative k (llama-cpp-python's -1) offloads everything.
    `output_first=None` (a llama.cpp whose rule is not known) takes the split with the smaller CPU
    share of the two, so that what is expected to be locked is CPU-resident under either rule."""
    n = info.block_count
    k = n + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n + 1)
    rules = [True, False] if output_first is None else [output_first]
    splits = [_split(info, n, k, rule) for rule in rules]
    return min(splits, key=lambda s: s.cpu)


def _split(info: GGUFInfo, n: int, k: int, output_first: bool) -> OffloadSplit:
    if output_first:
        output_gpu, first_gpu_block = k >= 1, n - max(k - 1, 0)
    else:
        output_gpu, first_gpu_block = k > n, n - min(k, n)
    cpu = gpu = cpu_end = 0
    names = {t.name for t in info.tensors}
    for t in info.tensors:
        slot = _layer(t.name, n)
        on_gpu = slot is not None and (output_gpu if slot == n else slot >= first_gpu_block)
        if on_gpu:
            gpu += t.nbytes
        else:
            cpu += t.nbytes
            cpu_end = max(cpu_end, t.offset + t.nbytes)
    embd = next((t.nbytes for t in info.tensors if t.name == "token_embd.weight"), 0)
    tied = "output.weight" not in names and embd > 0
    duplicated = embd if tied and output_gpu else 0
    return OffloadSplit(cpu=cpu, gpu=gpu + duplicated, duplicated=duplicated, gpu_layers=n - first_gpu_block,
                        output_on_gpu=output_gpu, locked=info.data_offset + cpu_end if cpu_end else 0)
