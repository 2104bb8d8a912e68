"""Sharded safetensors writing and all-or-nothing output directories."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from types import TracebackType

import torch
from ..progress import stderr_console
from .files import INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES
from .finite import require_finite

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``5GB`` (10**9), ``2GiB`` (2**30), ``500MB``, ``100KB``, ``1234``."""
    if isinstance(text, bool):
        raise ValueError(f"invalid size {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"invalid size {text!r}: expected a number with an optional unit "
                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '5GB' or '500MiB'"
            )
        value = int(Fraction(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    return value


def _shard_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def _part_name(index: int) -> str:
    return f".model-{index:05d}.safetensors.part"


def _detached_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor."""
    return tensor.detach().to("cpu").contiguous()


# safetensors' dtype names, in the order its serializer lays tensors out in a file: by its dtype
# enum, largest first, then by name. Writing that order ourselves makes a streamed shard
# byte-identical to `safetensors.torch.save_file` of the same tensors (tested).
_SAFETENSORS_DTYPES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.uint16: "U16", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_LAYOUT_RANK = {name: rank for rank, name in enumerate(_SAFETENSORS_DTYPES.values())}
_COPY_CHUNK = 64 * 2**20


def _write_safetensors(path: Path, entries: list[tuple[str, str, list[int], int, int]], data) -> None:
    """One safetensors file at `path` from tensors already spilled to the open file `data`.

    entries: (name, dtype name, shape, offset in `data`, bytes). Format: an 8-byte little-endian
    header length, the JSON header (spaces pad it to a multiple of 8), then the tensors' bytes.
    """
    order = sorted(entries, key=lambda e: (_LAYOUT_RANK[e[1]], e[0]))
    header: dict = {"__metadata__": {"format": "pt"}}
    start = 0
    for name, dtype, shape, _, nbytes in order:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + nbytes]}
        start += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for _, _, _, offset, nbytes in order:
            data.seek(offset)
            while nbytes:
                chunk = data.read(min(nbytes, _COPY_CHUNK))
                out.write(chunk)
                nbytes -= len(chunk)


class ShardedWriter:
    """Write tensors to safetensors shards of at most ``max_shard_bytes`` each.

    Nothing but the tensor being added is held in memory: each tensor is spilled to a scratch
    file beside the shards, and a full shard is written from it. :meth:`close` names the shards
    ``model-0000i-of-0000N.safetensors`` and writes ``model.safetensors.index.json``; a
    single shard is written as plain ``model.safetensors`` without an index. A tensor larger
    than the limit gets a shard of its own; a tensor holding NaN or Inf is refused by name. Used as a context manager, an exception
    discards the shards written so far instead of finishing.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int | str = DEFAULT_MAX_SHARD_BYTES):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = parse_size(max_shard_bytes)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stale = [p.name for p in self.out_dir.glob("model*.safetensors*")]
        if stale:
            raise FileExistsError(f"{self.out_dir} already holds checkpoint files: {stale[0]}")
        self._entries: list[tuple[str, str, list[int], int, int]] = []  # the shard being filled
        self._buffer_bytes = 0
        self._spill = None  # scratch file of the shard being filled
        self._parts: list[list[str]] = []  # tensor names per flushed shard
        self._names: set[str] = set()
        self._total_bytes = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes the current shard first if this one would overflow it."""
        if self._closed:
            raise RuntimeError("ShardedWriter is closed")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
        if name in self._names:
            raise ValueError(f"duplicate tensor name {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name!r}: safetensors cannot store dtype {tensor.dtype}")
        t = require_finite(_detached_cpu(tensor), f"output tensor {name!r}")
        if self._entries and self._buffer_bytes + t.nbytes > self.max_shard_bytes:
            self._flush()
        if self._spill is None:
            self._spill = open(self._spill_path(), "w+b")
        self._names.add(name)
        self._entries.append((name, _SAFETENSORS_DTYPES[t.dtype], list(t.shape), self._buffer_bytes, t.nbytes))
        self._spill.write(t.reshape(-1).view(torch.uint8).numpy())
        self._buffer_bytes += t.nbytes
        self._total_bytes += t.nbytes

    def _spill_path(self) -> Path:
        return self.out_dir / (_part_name(len(self._parts) + 1) + ".data")

    def _drop_spill(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None
            self._spill_path().unlink(missing_ok=True)

    def _flush(self) -> None:
        if not self._entries:
            return
        path = self.out_dir / _part_name(len(self._parts) + 1)
        self._spill.flush()
        _write_safetensors(path, self._entries, self._spill)
        self._drop_spill()
        usual_file_mode(path)
        self._parts.append([e[0] for e in self._entries])
        self._entries = []
        self._buffer_bytes = 0

    def close(self) -> list[str]:
        """Write the last shard, give shards their final names, write the index.

        Returns the file names written (shards, then the index if any).
        """
        if self._closed:
            raise RuntimeError("ShardedWriter is already closed")
        if not self._names:
            raise ValueError(f"no tensors were added; nothing to write to {self.out_dir}")
        self._flush()
        self._closed = True
        total = len(self._parts)
        if total == 1:
            os.replace(self.out_dir / _part_name(1), self.out_dir / SINGLE_FILE)
            return [SINGLE_FILE]
        weight_map: dict[str, str] = {}
        written: list[str] = []
        for i, names in enumerate(self._parts, start=1):
            final = _shard_name(i, total)
            os.replace(self.out_dir / _part_name(i), self.out_dir / final)
            weight_map.update((name, final) for name in names)
            written.append(final)
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return written + [INDEX_FILE]

    def abort(self) -> None:
        """Drop buffered tensors and delete shards flushed so far."""
        self._closed = True
        self._drop_spill()
        self._entries = []
        for i in range(1, len(self._parts) + 1):
            (self.out_dir / _part_name(i)).unlink(missing_ok=True)
        self._parts = []

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def _is_nonempty_dir(path: Path) -> bool:
    return any(path.iterdir())


def usual_file_mode(path: Path) -> None:
    """Give a file the mode a plain open() would (safetensors creates files owner-only, 0600)."""
    os.chmod(path, 0o666 & ~_current_umask())


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# A run's temporary folder is `.NAME.tmp-XXXX` beside its output NAME, with `.NAME.tmp-XXXX.lock`
# beside it: created first, removed last, and locked (flock) for as long as the run lives. The
# kernel drops the lock when the process dies, even by SIGKILL, so a later run can tell a dead
# run's folder (lock free, or no lock file at all) from a live one's (lock held).
TMP_MARK = ".tmp-"
LOCK_SUFFIX = ".lock"
OLD_SUFFIX = ".old"  # the previous output, moved aside while --force replaces it


def _tmp_owner_name(tmp_name: str) -> str:
    """`.NAME.tmp-XXXX` -> NAME."""
    return tmp_name[1 : tmp_name.rindex(TMP_MARK)]


def _try_lock(path: Path) -> int | None:
    """An fd holding the exclusive lock on ``path``, or None if a live process holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _holds_only_checkpoint_files(folder: Path) -> bool:
    """Whether every entry is a file a conversion writes: never delete someone else's folder."""
    ours = {"config.json", *TOKENIZER_FILES}
    return all(
        p.is_file() and not p.is_symlink()
        and (p.name in ours or p.name.startswith(("model", ".model-", "chat_template", "transmla_")))
        for p in folder.iterdir()
    )


def remove_stale_temporaries(parent: Path) -> list[str]:
    """Remove the temporary folders that dead runs left in ``parent``; return what was done.

    A killed run's previous output, moved aside by --force, is put back when nothing replaced it.
    """
    done: list[str] = []
    if not parent.is_dir():
        return done
    for entry in sorted(parent.glob(f".*{TMP_MARK}*")):
        name = entry.name
        if name.endswith(LOCK_SUFFIX) or name.endswith(OLD_SUFFIX) or not entry.is_dir() or entry.is_symlink():
            continue
        lock = parent / (name + LOCK_SUFFIX)
        if lock.exists():
            fd = _try_lock(lock)
            if fd is None:
                continue  # a live run
        elif _holds_only_checkpoint_files(entry):  # an older version's run (no lock file)
            fd = -1
        else:
            continue
        try:
            if not entry.exists():  # finished while we looked
                continue
            old = parent / (name + OLD_SUFFIX)
            target = parent / _tmp_owner_name(name)
            if old.is_dir() and not target.exists() and not target.is_symlink():
                os.replace(old, target)
                done.append(f"restored {target} (a killed run had moved it aside)")
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry}, left by an interrupted run")
        finally:
            if fd >= 0:
                lock.unlink(missing_ok=True)
                os.close(fd)
    for lock in parent.glob(f".*{TMP_MARK}*{LOCK_SUFFIX}"):  # locks whose folder is gone
        folder = parent / lock.name[: -len(LOCK_SUFFIX)]
        if not folder.exists():
            fd = _try_lock(lock)
            if fd is not None:
                lock.unlink(missing_ok=True)
                os.close(fd)
    return done


@contextmanager
def scratch_dir(parent: Path, name: str) -> Iterator[Path]:
    """A new `.NAME.tmp-XXXX` folder in ``parent``, locked by this process; removed at the end
    unless it was moved away (the lock is released only after that)."""
    fd, lock_name = tempfile.mkstemp(prefix=f".{name}{TMP_MARK}", suffix=LOCK_SUFFIX, dir=parent)
    lock = Path(lock_name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        tmp = Path(lock_name[: -len(LOCK_SUFFIX)])
        tmp.mkdir(mode=0o777 & ~_current_umask())
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it became the output
        lock.unlink(missing_ok=True)
        os.close(fd)


@contextmanager
def atomic_output_dir(target: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``target`` that becomes ``target`` on success.

    A non-empty existing ``target`` is refused unless ``force``; with ``force`` the old
    directory is removed only after the new one is complete. On any exception (including
    KeyboardInterrupt, which the CLI raises for SIGTERM too) the temporary directory is deleted;
    a run killed outright leaves it behind, and the next run into the same parent removes it.
    """
    target = Path(os.path.abspath(target))

    def check() -> None:
        if target.exists() or target.is_symlink():
            if not target.is_dir() or target.is_symlink():
                raise FileExistsError(f"output path {target} exists and is not a directory")
            if not force and _is_nonempty_dir(target):
                raise FileExistsError(
                    f"output directory {target} exists and is not empty; "
                    "pass --force to replace it"
                )

    check()
    target.parent.mkdir(parents=True, exist_ok=True)
    for line in remove_stale_temporaries(target.parent):
        stderr_console.print(f"[dim]{line}[/dim]", highlight=False)
    with scratch_dir(target.parent, target.name) as tmp:
        yield tmp
        check()
        if target.exists():
            old = tmp.with_name(tmp.name + OLD_SUFFIX)
            os.replace(target, old)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
