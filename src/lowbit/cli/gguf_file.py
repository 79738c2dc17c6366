"""``quantize-llm``'s look at a ``.gguf`` file before ``transformers`` reads it: magic, header, tensor types, sizes.

``transformers`` hands a GGUF file to the ``gguf`` package, whose errors name neither the tensor nor the problem
("cannot reshape array of size 1298 into shape (32,64)" for a cut file, "Dequantization for I8 is not yet
implemented", "np.uint32(99) is not a valid GGMLQuantizationType"). The header is read here first::

    "GGUF"  u32 version (2 or 3)  u64 n_tensors  u64 n_kv
    n_kv x      (string key, u32 value type, value)        # value: scalar, string (u64 length + bytes) or array
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to general.alignment (default 32), then the tensor data; tensor i occupies
    [data + offset_i, data + offset_i + n_elements_i / block_size * type_size)   (GGML_QUANT_SIZES)

and every fault is a ``CLIError`` naming the file and, for a tensor, its name and type: not a GGUF file, a version the
reader does not take, a header or tensor cut off by the end of the file, a type id ``gguf`` does not know or a type it
cannot dequantize. Byte order: little-endian, or big-endian files (their version reads byte-swapped), as ``gguf``.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path
from typing import Any, BinaryIO

from .common import CLIError

__all__ = ["check_gguf"]

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Short(Exception):
    """The file ended inside the header."""


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size, self.order = f, size, "<"

    def read(self, n: int) -> bytes:
        b = self.f.read(n) if n <= self.size - self.f.tell() else b""
        if len(b) < n:
            raise _Short
        return b

    def num(self, fmt: str) -> Any:
        return struct.unpack(self.order + fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.read(self.num("Q"))

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            self.string()
        elif vtype == _ARRAY:
            itype, n = self.num("I"), self.num("Q")
            if itype in _SCALARS:  # (a length past the file's end is a cut-off header, not a huge seek)
                if n * struct.calcsize(_SCALARS[itype]) > self.size - self.f.tell():
                    raise _Short
                self.f.seek(n * struct.calcsize(_SCALARS[itype]), 1)
            else:
                for _ in range(n):
                    self.skip_value(itype)
        elif vtype in _SCALARS:
            self.read(struct.calcsize(_SCALARS[vtype]))
        else:
            raise ValueError(f"metadata value type {vtype}")


@functools.lru_cache(maxsize=None)
def _dequantizable(qtype: Any) -> bool:
    """Whether the installed ``gguf`` dequantizes ``qtype`` (what ``transformers`` calls), tried on one zero block."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, quants

    try:
        quants.dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 (any other failure on zeros is not "unsupported": transformers will say)
        return True
    return True


def _types_read() -> str:
    from gguf import GGMLQuantizationType

    return ", ".join(t.name for t in GGMLQuantizationType if _dequantizable(t))


def check_gguf(path: Path) -> None:
    """``CLIError`` naming what is wrong with the GGUF file ``path`` (see the module docstring); ``None`` if sound.

    Without the ``gguf`` package nothing is checked (``transformers`` names the missing package)."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return
    name = path.name
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size)
        where = "its first bytes"
        try:
            magic = r.read(4)
            if magic != b"GGUF":
                raise CLIError(f"MODEL {name} is not a GGUF file: it starts with {magic!r}, not the magic b'GGUF'")
            version = r.num("I")
            if version & 0xFFFF == 0 and version:  # written big-endian
                r.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
            if version not in (2, 3):
                raise CLIError(f"MODEL {name}: GGUF version {version}; the gguf reader takes versions 2 and 3")
            n_tensors, n_kv = r.num("Q"), r.num("Q")
            alignment = 32
            for i in range(n_kv):
                where = f"metadata entry {i} of {n_kv}"
                key, vtype = r.string(), r.num("I")
                if key == b"general.alignment" and vtype in _SCALARS:
                    alignment = r.num(_SCALARS[vtype])
                else:
                    r.skip_value(vtype)
            tensors = []
            for i in range(n_tensors):
                where = f"tensor entry {i} of {n_tensors}"
                tname = r.string().decode("utf-8", "replace")
                dims = [r.num("Q") for _ in range(r.num("I"))]
                tensors.append((tname, dims, r.num("I"), r.num("Q")))
            header_end = f.tell()
        except _Short:
            raise CLIError(f"MODEL {name} is truncated: its {size} bytes end inside the header ({where})") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CLIError(f"MODEL {name}: its header is damaged at {where} (unknown {e})") from None
    if not isinstance(alignment, int) or alignment <= 0:
        raise CLIError(f"MODEL {name}: general.alignment={alignment!r} must be a positive integer")
    data = -(-header_end // alignment) * alignment
    for tname, dims, type_id, offset in tensors:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise CLIError(f"MODEL {name}: tensor {tname!r} has GGML type id {type_id}, which the installed gguf "
                           "package does not know (a newer llama.cpp type, or a damaged file)") from None
        if not _dequantizable(qtype):
            raise CLIError(f"MODEL {name}: tensor {tname!r} has GGML type {qtype.name}, which the installed gguf "
                           f"package cannot dequantize (types it reads: {_types_read()}); convert the file with "
                           "llama.cpp's llama-quantize or export the model as a Hugging Face directory")
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = 1
        for d in dims:
            n *= d
        if n % block or (dims and dims[0] % block):
            raise CLIError(f"MODEL {name}: tensor {tname!r} ({qtype.name}, shape {dims}) is not a whole number of "
                           f"{qtype.name} blocks of {block} values per row: the header is damaged")
        end = data + offset + n // block * type_size
        if end > size:
            raise CLIError(f"MODEL {name} is truncated: tensor {tname!r} ({qtype.name}, {n // block * type_size} bytes "
                           f"from byte {data + offset}) ends at byte {end}, past the file's end ({size} bytes)")
