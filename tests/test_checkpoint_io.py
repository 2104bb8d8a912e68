"""Checkpoint I/O: sharded writer, lazy reader, atomic output dirs, tokenizer copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from transmla.checkpoint.files import TOKENIZER_FILES, copy_tokenizer_files
from transmla.checkpoint.reader import SafetensorsReader
from transmla.checkpoint.writer import ShardedWriter, atomic_output_dir, parse_size


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.{kind}.weight": torch.randn(8, 8, generator=g).to(dtype)
        for i in range(3)
        for kind, dtype in (("q_proj", torch.float32), ("k_proj", torch.bfloat16))
    } | {"model.norm.weight": torch.arange(8, dtype=torch.int64)}


def _write(out: Path, tensors: dict[str, torch.Tensor], max_bytes: int | str) -> list[str]:
    writer = ShardedWriter(out, max_shard_bytes=max_bytes)
    for name, t in tensors.items():
        writer.add(name, t)
    return writer.close()


def test_multi_shard_round_trip(tmp_path: Path) -> None:
    tensors = _tensors()
    # a float32 8x8 is 256 bytes: a 300-byte limit forces many shards.
    written = _write(tmp_path / "out", tensors, 300)
    out = tmp_path / "out"
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3
    assert written == shards + ["model.safetensors.index.json"]
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert f.keys()  # no empty shard
            assert sum(f.get_tensor(k).nbytes for k in f.keys()) <= 300

    with SafetensorsReader(out) as reader:
        assert sorted(reader.keys()) == sorted(tensors)
        assert "model.norm.weight" in reader and "nope" not in reader
        for name, t in tensors.items():
            assert reader.dtype_of(name) == t.dtype
            assert reader.shape_of(name) == tuple(t.shape)
            got = reader.get(name)
            assert got.dtype == t.dtype and torch.equal(got, t)

    # plain safetensors, following the index by hand
    loaded: dict[str, torch.Tensor] = {}
    for shard in set(index["weight_map"].values()):
        loaded |= load_file(str(out / shard))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_single_shard_writes_plain_file(tmp_path: Path) -> None:
    tensors = _tensors()
    assert _write(tmp_path, tensors, "1MB") == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with SafetensorsReader(tmp_path) as reader:
        assert reader.keys() == sorted(tensors)


def test_oversized_tensor_gets_own_shard(tmp_path: Path) -> None:
    _write(tmp_path, {"a": torch.zeros(4), "big": torch.zeros(100), "c": torch.zeros(4)}, 64)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3


def test_writer_contiguous_views_and_duplicates(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    writer = ShardedWriter(tmp_path)
    writer.add("t", base.t())  # non-contiguous
    writer.add("row", base[1])  # view sharing storage with `base`
    with pytest.raises(ValueError, match="duplicate"):
        writer.add("t", base)
    writer.close()
    with SafetensorsReader(tmp_path) as reader:
        assert torch.equal(reader.get("t"), base.t())
        assert torch.equal(reader.get("row"), base[1])


def test_streamed_shard_is_byte_identical_to_safetensors(tmp_path: Path) -> None:
    # The writer spills tensors to disk and lays the shard out itself; the file must be exactly
    # what safetensors writes for the same tensors (its order: dtype, largest first, then name).
    g = torch.Generator().manual_seed(0)
    tensors = {
        "z.bf16": torch.randn(3, 5, generator=g).bfloat16(), "a.f32": torch.randn(7, generator=g),
        "m.f16": torch.randn(2, 2, generator=g).half(), "b.i64": torch.arange(5), "c.f64": torch.randn(1, generator=g).double(),
        "e.empty": torch.zeros(0, 4), "s.scalar": torch.tensor(2.5), "k.bool": torch.tensor([True, False, True]),
        "a.f16": torch.ones(3, dtype=torch.float16), "q.i8": torch.arange(-3, 3, dtype=torch.int8),
    }
    with ShardedWriter(tmp_path / "ours") as writer:
        for name, t in tensors.items():
            writer.add(name, t)
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["model.safetensors"]  # no scratch left


def test_writer_refuses_dtypes_safetensors_cannot_store(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="complex64"):
        ShardedWriter(tmp_path).add("c", torch.zeros(2, dtype=torch.complex64))


def test_writer_aborts_on_exception(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with ShardedWriter(tmp_path, max_shard_bytes=16) as writer:
            for i in range(4):
                writer.add(f"w{i}", torch.zeros(4))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("100KB", 100_000),
        ("100kb", 100_000),
        (" 1.5 MiB ", 3 * 2**19),
        ("1234", 1234),
        ("64B", 64),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "5XB", "-5GB", "5 G B", "0", 0, -1, "1e9", True])
def test_parse_size_errors(bad: str | int) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)


def test_atomic_output_dir_success(tmp_path: Path) -> None:
    target = tmp_path / "converted"
    with atomic_output_dir(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".converted.tmp-")
        assert not target.exists()
        (tmp / "config.json").write_text("{}")
    assert (target / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_atomic_output_dir_failure_leaves_nothing(tmp_path: Path, exc: type) -> None:
    target = tmp_path / "converted"
    with pytest.raises(exc):
        with atomic_output_dir(target) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise exc()
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_dir_existing_target(tmp_path: Path) -> None:
    target = tmp_path / "converted"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match="--force"):
        with atomic_output_dir(target):
            pytest.fail("body must not run")
    assert (target / "old.txt").exists()

    # a failure under --force keeps the old output
    with pytest.raises(RuntimeError):
        with atomic_output_dir(target, force=True):
            raise RuntimeError("boom")
    assert (target / "old.txt").exists()

    with atomic_output_dir(target, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]


def test_atomic_output_dir_empty_target_and_file_target(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_output_dir(empty) as tmp:
        (tmp / "a").write_text("a")
    assert (empty / "a").exists()

    file_target = tmp_path / "file"
    file_target.write_text("x")
    for force in (False, True):
        with pytest.raises(FileExistsError, match="not a directory"):
            with atomic_output_dir(file_target, force=force):
                pass
    assert file_target.read_text() == "x"


def test_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing"):
        SafetensorsReader(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        SafetensorsReader(tmp_path)
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with SafetensorsReader(tmp_path) as reader:
        with pytest.raises(KeyError, match="b"):
            reader.get("b")
        with pytest.raises(KeyError):
            reader.shape_of("b")


def test_reader_unindexed_shards_and_missing_shard(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "part-a.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "part-b.safetensors"))
    with SafetensorsReader(tmp_path) as reader:
        assert reader.keys() == ["a", "b"]
        assert torch.equal(reader.get("b"), torch.zeros(3))

    indexed = tmp_path / "indexed"
    indexed.mkdir()
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (indexed / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        SafetensorsReader(indexed)


def test_copy_tokenizer_files(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    present = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    for name in present + ["chat_template.jinja", "config.json", "model.safetensors"]:
        (src / name).write_text(f'"{name}"' if name.endswith(".json") else name)  # JSON files must parse
    copied = copy_tokenizer_files(src, dst)
    assert sorted(copied) == sorted(present + ["chat_template.jinja"])
    assert sorted(p.name for p in dst.iterdir()) == sorted(copied)
    assert (dst / "chat_template.jinja").read_text() == "chat_template.jinja"
    assert "merges.txt" in TOKENIZER_FILES and "merges.txt" not in copied
