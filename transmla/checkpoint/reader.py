"""Lazy, one-tensor-at-a-time reading of a safetensors checkpoint directory.

Tensors are read with plain file reads into memory of their own, not through a memory map: the
pages of a mapped checkpoint stay resident while it is open, so streaming a 7 GB checkpoint
through one would count 7 GB against the process (measured on a 1.5B model).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from .files import INDEX_FILE, SINGLE_FILE
from .finite import require_finite


# safetensors header dtype strings -> torch dtypes (only those this torch build has).
_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "U16": "uint16",
        "I16": "int16",
        "F16": "float16",
        "BF16": "bfloat16",
        "U32": "uint32",
        "I32": "int32",
        "F32": "float32",
        "U64": "uint64",
        "I64": "int64",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }.items()
    if hasattr(torch, name)
}


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class SafetensorsReader:
    """Read tensors by name from a directory of safetensors files.

    Layouts, in the order transformers tries them: a single ``model.safetensors``; shards
    listed by ``model.safetensors.index.json``; otherwise every ``*.safetensors`` file.
    File handles are opened on first use and kept until :meth:`close`.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {self.directory}")
        self._handles: dict[str, Any] = {}
        self._layouts: dict[str, tuple[int, dict]] = {}  # file -> (data start, header)
        self._weight_map: dict[str, str] = self._discover()

    # -- discovery -------------------------------------------------------------------------

    def _discover(self) -> dict[str, str]:
        d = self.directory
        if (d / SINGLE_FILE).is_file():
            return self._map_files([SINGLE_FILE])
        if (d / INDEX_FILE).is_file():
            return self._map_index(d / INDEX_FILE)
        files = sorted(p.name for p in d.glob("*.safetensors") if p.is_file())
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {d}")
        return self._map_files(files)

    def _map_index(self, index_path: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed safetensors index {index_path}: {exc}") from exc
        for shard in sorted(set(weight_map.values())):
            if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
                raise ValueError(f"malformed safetensors index {index_path}: shard {shard!r} is not a file name in {self.directory}")
            if not (self.directory / shard).is_file():
                raise FileNotFoundError(
                    f"shard {shard} listed in {index_path} is missing from {self.directory}"
                )
        return dict(weight_map)

    def _map_files(self, files: list[str]) -> dict[str, str]:
        weight_map: dict[str, str] = {}
        for file in files:
            for key in self._handle(file).keys():
                if key in weight_map:
                    raise ValueError(
                        f"tensor {key!r} appears in both {weight_map[key]} and {file} "
                        f"in {self.directory}"
                    )
                weight_map[key] = file
        return weight_map

    def _handle(self, file: str) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            path = self.directory / file
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # truncated or not safetensors at all: name the file
                raise ValueError(f"cannot read {path}: {_first_line(e)} (truncated or not a safetensors file?)") from None
            self._handles[file] = handle
        return handle

    def _file_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.directory}") from None

    # -- public API ------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def __len__(self) -> int:
        return len(self._weight_map)

    def files(self) -> list[str]:
        """The safetensors file names that hold the tensors."""
        return sorted(set(self._weight_map.values()))

    def _layout(self, file: str) -> tuple[int, dict]:
        """(offset of the data, header) of a file whose header safe_open has already checked."""
        if file not in self._layouts:
            self._handle(file)
            with open(self.directory / file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                self._layouts[file] = (8 + length, json.loads(f.read(length)))
        return self._layouts[file]

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (CPU, stored dtype); a tensor holding NaN or Inf is refused, by name."""
        file = self._file_of(name)
        path = self.directory / file
        base, header = self._layout(file)
        start, end = header[name]["data_offsets"]
        tensor = torch.empty(self.shape_of(name), dtype=self.dtype_of(name))
        with open(path, "rb") as f:
            f.seek(base + start)
            read = f.readinto(tensor.reshape(-1).view(torch.uint8).numpy())  # straight into the tensor
        if read != end - start:  # a shard cut short after its header
            raise ValueError(f"cannot read tensor {name!r} from {path}: {read} of its {end - start} bytes are there")
        return require_finite(tensor, f"tensor {name!r} in {path}")

    def dtype_of(self, name: str) -> torch.dtype:
        """Stored dtype of a tensor, read from the header only."""
        code = self._handle(self._file_of(name)).get_slice(name).get_dtype()
        try:
            return _DTYPES[code]
        except KeyError:
            raise ValueError(f"tensor {name!r} has unsupported dtype {code}") from None

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor, read from the header only."""
        return tuple(self._handle(self._file_of(name)).get_slice(name).get_shape())

    def close(self) -> None:
        """Close every open file handle (the reader can still be reopened lazily)."""
        handles, self._handles = self._handles, {}
        self._layouts = {}
        for handle in handles.values():
            handle.__exit__(None, None, None)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsReader({str(self.directory)!r}, tensors={len(self)})"
