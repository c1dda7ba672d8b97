"""A GGUF file's weights under the names the decoder gives its parameters, read one tensor at a time.

transformers reads a GGUF checkpoint by dequantizing every tensor to fp32 at once: an 8B Q4_K_M file of 4.9 GB
becomes 32 GB in memory before anything else happens. Here the file is memory-mapped and each tensor is dequantized
on request (`gguf.quants.dequantize`, llama.cpp's own Python package), so a loader that turns each layer into its
stored form before asking for the next (models/loader.py) holds one layer in fp32 at a time.

The tensors are found from the file's header alone (`read_index`): the metadata values are stepped over, not parsed.
`gguf.GGUFReader` parses every value into numpy objects, a tokenizer's 100k strings included: 5 s and ~140 MiB for
SmolLM2's 49k-token vocabulary, against 0.16 s here.

Names: `gguf.get_tensor_name_map` maps the decoder's (transformers') names to the file's (`model.layers.3.
self_attn.q_proj.weight` -> `blk.3.attn_q.weight`). llama.cpp's converter permutes the rows of a Llama-architecture
model's Q and K projections (its rotary layout pairs neighbours; transformers' pairs halves); that is undone here,
as transformers' own GGUF reader does. Architectures whose GGUF tensors need more than renaming and that permutation
(Gemma's norms stored as 1 + w, ...) are not read here: `DIRECT_ARCHS` lists those that are.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any
import numpy as np
import torch

logger = logging.getLogger(__name__)

# the GGUF architectures whose tensors map to this project's decoders by name alone (plus Llama's Q/K permutation)
DIRECT_ARCHS = ("llama", "qwen2", "qwen3")
_PERMUTED_ARCHS = ("llama",)


def gguf_architecture(path: str | Path) -> str:
    """`general.architecture` of a GGUF file."""
    return gguf_summary(path)[0]


def gguf_summary(path: str | Path) -> tuple[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """(architecture, {tensor: (storage form, shape as GGUF lists it)}) of a GGUF file, read once per file version."""
    st = Path(path).resolve().stat()
    return _summary(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _summary(path: str, size: int, mtime_ns: int) -> tuple[str, dict[str, tuple[str, tuple[int, ...]]]]:
    arch, tensors, _ = read_index(path)
    return arch, {t.name: (t.form.name, tuple(t.dims)) for t in tensors}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    form: Any  # gguf.GGMLQuantizationType
    dims: list[int]  # innermost first, as GGUF lists them
    offset: int  # of its data, from the file's start


_SCALAR_BYTES = {"UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "UINT32": 4, "INT32": 4, "FLOAT32": 4, "BOOL": 1,
                 "UINT64": 8, "INT64": 8, "FLOAT64": 8}


def read_index(path: str | Path) -> tuple[str, list[TensorInfo], np.memmap]:
    """(architecture, the tensors, the file memory-mapped) of a GGUF file (format v2 and v3), from its header: the
    key-value metadata is stepped over, only `general.architecture` and `general.alignment` are read."""
    import gguf

    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string(keep: bool = True) -> str:
        nonlocal pos
        n = take("Q")
        text = bytes(buf[pos:pos + n]).decode("utf-8", errors="replace") if keep else ""
        pos += n
        return text

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    pos = 4
    version = take("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read here (2 and 3 are)")
    n_tensors, n_kv = take("Q"), take("Q")
    kinds = gguf.GGUFValueType
    arch, alignment = "", 32
    for _ in range(n_kv):
        key = string()
        kind = kinds(take("I"))
        if kind == kinds.STRING:
            value = string(keep=key == "general.architecture")
            arch = value if key == "general.architecture" else arch
        elif kind == kinds.ARRAY:
            item, count = kinds(take("I")), take("Q")
            if item == kinds.STRING:
                for _ in range(count):
                    string(keep=False)
            else:
                pos += _SCALAR_BYTES[item.name] * count
        elif key == "general.alignment":
            alignment = take("I")
        else:
            pos += _SCALAR_BYTES[kind.name]
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, gguf.GGMLQuantizationType(take("I")), dims, take("Q")))
    start = pos + (-pos % alignment)
    return arch, [TensorInfo(n, f, d, start + o) for n, f, d, o in infos], data


def _tensor_data(data: np.memmap, info: TensorInfo) -> np.ndarray:
    """A tensor's stored data as `gguf.quants.dequantize` takes it: float and integer forms as their own dtype,
    block forms as bytes, one row of blocks per output row (what gguf's own reader gives)."""
    import gguf

    forms = gguf.GGMLQuantizationType
    shape = tuple(reversed(info.dims))
    plain = {forms.F32: np.float32, forms.F16: np.float16, forms.F64: np.float64, forms.I8: np.int8,
             forms.I16: np.int16, forms.I32: np.int32, forms.I64: np.int64}
    block, size = gguf.GGML_QUANT_SIZES[info.form]
    count = int(np.prod(info.dims)) * size // block
    if info.form in plain:
        return data[info.offset:info.offset + count].view(plain[info.form]).reshape(shape)
    return data[info.offset:info.offset + count].reshape(gguf.quant_shape_to_byte_shape(shape, info.form))


class GGUFWeights:
    """The tensors of the GGUF file at `path`, as fp32 torch tensors shaped as the decoder's parameters
    (`[out, in]` for a matrix), for a decoder with `num_layers` layers, `num_heads` attention heads and
    `num_kv_heads` key/value heads."""

    def __init__(self, path: str | Path, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        import gguf

        self.path = Path(path)
        self.arch, tensors, self._data = read_index(path)
        if self.arch not in DIRECT_ARCHS:
            raise ValueError(f"{self.path.name}: GGUF architecture {self.arch!r} is not read directly "
                             f"(only {', '.join(DIRECT_ARCHS)})")
        arch_id = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[self.arch]
        self._names = gguf.get_tensor_name_map(arch_id, num_layers)
        self._tensors = {t.name: t for t in tensors}
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads

    def file_name(self, name: str) -> str | None:
        """The file's name for the parameter `name`, or None when the file has no such tensor."""
        if name == "lm_head.weight" and "output.weight" not in self._tensors:
            return None  # NOTE: a tied head is stored once, as the token embeddings
        mapped = self._names.get_name(name, try_suffixes=(".weight", ".bias"))
        return mapped if mapped in self._tensors else None

    def has(self, name: str) -> bool:
        return self.file_name(name) is not None

    def tensor_type(self, name: str) -> str:
        """The file's storage form of `name` (`Q4_1`, `Q8_0`, `F32`, ...)."""
        return self._tensors[self._file_name(name)].form.name

    def unread(self, names: set[str]) -> list[str]:
        """The file's tensors that none of `names` (the decoder's parameters) reads."""
        read = {self.file_name(n) for n in names}
        return sorted(set(self._tensors) - read)

    def get(self, name: str) -> torch.Tensor:
        """The parameter `name`, dequantized to fp32."""
        file_name = self._file_name(name)
        weights = self._read(file_name, None)
        if self.arch in _PERMUTED_ARCHS and file_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.num_heads if "attn_q" in file_name else self.num_kv_heads
            weights = _unpermute(weights, heads)
        return weights

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the matrix `name`, dequantized to fp32 (a large table read in pieces). Not for the
        permuted Q/K projections."""
        file_name = self._file_name(name)
        assert not (self.arch in _PERMUTED_ARCHS and file_name.endswith(("attn_q.weight", "attn_k.weight")))
        return self._read(file_name, slice(start, stop))

    def _read(self, file_name: str, rows: slice | None) -> torch.Tensor:
        import gguf

        tensor = self._tensors[file_name]
        # NOTE: the raw data has one row per output row (a quantized row as its blocks' bytes); GGUF lists the
        # dimensions innermost first
        shape = [int(d) for d in reversed(tensor.dims)]
        raw = _tensor_data(self._data, tensor)
        if rows is not None:
            raw = raw[rows]
            shape[0] = raw.shape[0]
        values = np.asarray(gguf.quants.dequantize(raw, tensor.form), dtype=np.float32)
        if not values.flags.writeable:  # NOTE: an F32 tensor comes back as a view of the read-only mapped file
            values = values.copy()
        return torch.from_numpy(values.reshape(shape))

    def _file_name(self, name: str) -> str:
        file_name = self.file_name(name)
        if file_name is None:
            raise KeyError(f"{self.path.name} has no tensor for {name}")
        return file_name


def _unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head, rows (pairs of neighbours) back to (first half, second
    half), the layout the rotary embedding here (and transformers') expects."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)
