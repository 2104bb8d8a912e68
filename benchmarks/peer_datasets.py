"""A stand-in for Hugging Face `datasets` in the peers' code (CARE, the public TransMLA): their utils import it
for Dataset.from_dict / filter / set_transform around a list of strings, and datasets 5.2 with pyarrow 26 cannot
even build a Dataset here (its fingerprint pickling fails on pyarrow's MonthDayNano). Rows has those operations
(the same row order, filtering and per-batch transform). Imports nothing of transmla: the public TransMLA runs in
a virtual environment of its own (benchmarks/public_transmla.py) and loads this file by its path."""

from __future__ import annotations

import sys


class Rows:
    """What the peers' prepare_dataloader uses of a datasets.Dataset: from_dict, column_names, filter (a row
    predicate), column access, set_transform (a batch transform), and the rows a DataLoader fetches."""

    def __init__(self, columns: dict[str, list]) -> None:
        self._columns, self._transform = columns, None

    @classmethod
    def from_dict(cls, columns: dict[str, list]) -> "Rows":
        return cls({k: list(v) for k, v in columns.items()})

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    def __len__(self) -> int:
        return len(next(iter(self._columns.values())))

    def filter(self, keep) -> "Rows":
        rows = [i for i in range(len(self)) if keep({k: v[i] for k, v in self._columns.items()})]
        return Rows({k: [v[i] for i in rows] for k, v in self._columns.items()})

    def set_transform(self, transform) -> None:
        self._transform = transform

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._columns[key]
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[int]) -> list[dict]:
        # as datasets does: the transform on the batch, then one dict per row (the DataLoader collates them)
        batch = {k: [v[i] for i in keys] for k, v in self._columns.items()}
        batch = self._transform(batch) if self._transform else batch
        return [{k: v[i] for k, v in batch.items()} for i in range(len(keys))]


def datasets_stand_in() -> None:
    """`import datasets` in a peer's utils finds Rows (it only names the module's types otherwise)."""
    import types

    module = types.ModuleType("datasets")
    module.Dataset, module.DatasetDict = Rows, dict
    sys.modules["datasets"] = module
