"""A GGUF file's weights under the names the decoder gives its parameters, read one tensor at a time.

transformers reads a GGUF checkpoint by dequantizing every tensor to fp32 at once: an 8B Q4_K_M file of 4.9 GB
becomes 32 GB in memory before anything else happens. Here the file is memory-mapped (`gguf.GGUFReader`) and each
tensor is dequantized on request (`gguf.quants.dequantize`, llama.cpp's own Python package), so a loader that turns
each layer into its stored form before asking for the next (models/loader.py) holds one layer in fp32 at a time.

Names: `gguf.get_tensor_name_map` maps the decoder's (transformers') names to the file's (`model.layers.3.
self_attn.q_proj.weight` -> `blk.3.attn_q.weight`). llama.cpp's converter permutes the rows of a Llama-architecture
model's Q and K projections (its rotary layout pairs neighbours; transformers' pairs halves); that is undone here,
as transformers' own GGUF reader does. Architectures whose GGUF tensors need more than renaming and that permutation
(Gemma's norms stored as 1 + w, ...) are not read here: `DIRECT_ARCHS` lists those that are.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
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
    """(architecture, {tensor: (storage form, shape as GGUF lists it)}) of a GGUF file, read once per file version:
    parsing the metadata builds an object per vocabulary entry (~140 MB for a 49k-token vocabulary)."""
    st = Path(path).resolve().stat()
    return _summary(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _summary(path: str, size: int, mtime_ns: int) -> tuple[str, dict[str, tuple[str, tuple[int, ...]]]]:
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    return arch, {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in reader.tensors}


class GGUFWeights:
    """The tensors of the GGUF file at `path`, as fp32 torch tensors shaped as the decoder's parameters
    (`[out, in]` for a matrix), for a decoder with `num_layers` layers, `num_heads` attention heads and
    `num_kv_heads` key/value heads."""

    def __init__(self, path: str | Path, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        import gguf

        self.path = Path(path)
        self.reader = gguf.GGUFReader(str(path))
        field = self.reader.fields["general.architecture"]
        self.arch = bytes(field.parts[field.data[0]]).decode()
        if self.arch not in DIRECT_ARCHS:
            raise ValueError(f"{self.path.name}: GGUF architecture {self.arch!r} is not read directly "
                             f"(only {', '.join(DIRECT_ARCHS)})")
        arch_id = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[self.arch]
        self._names = gguf.get_tensor_name_map(arch_id, num_layers)
        self._tensors = {t.name: t for t in self.reader.tensors}
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
        return self._tensors[self._file_name(name)].tensor_type.name

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
        shape = [int(d) for d in reversed(tensor.shape)]
        raw = tensor.data if rows is None else tensor.data[rows]
        if rows is not None:
            shape[0] = raw.shape[0]
        values = np.asarray(gguf.quants.dequantize(raw, tensor.tensor_type), dtype=np.float32)
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
