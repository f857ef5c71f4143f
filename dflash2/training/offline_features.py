"""``data.features=offline``: train from taps computed once by ``python -m dflash2.data.features`` (issue 15).

The regenerated split is found as in online training; its feature folder
``<data.features_dir or <cache>/features>/<split>-<key>/`` must hold a complete set whose manifest
names this run's target (weight hash), dtype, taps and that very data set, else the run stops with
one line saying what differs and the command that computes the right features. Each batch then
carries ``target_taps`` (N, L, K*d) (``drafter_data.collate_sequences`` pads them) and
``DrafterTrainingModule`` skips the target's forward; the
target stays loaded for its embedding and LM head (the loss) and the held-out measurement.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash2.data.feature_shards import FeatureStore, read_manifest
from dflash2.data.features import manifest_for
from dflash2.errors import DFlash2Error

MODES = ("online", "offline")
ROW = "feature_row"  # the dataset row a sequence had before filtering: its key in the feature store


def features_mode(data: dict) -> str:
    mode = str(data.get("features", "online"))
    if mode not in MODES:
        raise DFlash2Error(f"data.features={mode!r}: use online (the target runs every step) or offline")
    return mode


def dataset_folder(dataset) -> Path:
    """The ``<cache>/data/<split>-<key>`` folder a regenerated split was loaded from."""
    files = [Path(f["filename"]) for f in dataset.cache_files]
    if not files:
        raise DFlash2Error("data.features=offline needs the regenerated data on disk (an in-memory data set came)")
    return files[0].parent


class OfflineFeatures:
    """Attaches the stored features to each regenerated split of a run (``attach``, before filtering)."""

    def __init__(self, target, *, target_id: str, features_root: Path):
        self.target, self.target_id, self.root = target, str(target_id), Path(features_root)
        self.stores: dict[str, FeatureStore] = {}

    def attach(self, dataset, split: str):
        """Check the split's features against the run (one-line error) and add the ``feature_row`` column."""
        data_dir = dataset_folder(dataset)
        folder = self.root / data_dir.name
        found = read_manifest(folder)
        expected = manifest_for(
            self.target,
            dataset,
            target_id=self.target_id,
            data_name=data_dir.name,
            top_k=found.top_k if found else 0,  # top-k and sharding are the job's choice, not the run's
            rows_per_shard=found.rows_per_shard if found else 1,
        )
        command = (
            f"python -m dflash2.data.features --target {self.target_id} --data {data_dir} --out {self.root} "
            f"--taps {','.join(map(str, expected.taps))} --dtype {expected.dtype}"
        )
        if found is None or not found.complete:
            state = "no" if found is None else "incomplete"
            raise DFlash2Error(
                f"data.features=offline: {state} features of the {split} split in {folder}; run {command}"
            )
        diff = found.differences(expected)
        if diff:
            raise DFlash2Error(
                f"data.features=offline: the features in {folder} do not match this run "
                f"(stored vs run: {'; '.join(diff[:3])}); recompute them with {command}"
            )
        self.stores[split] = FeatureStore(folder, found)
        return dataset.add_column(ROW, list(range(len(dataset))))

    def wrap(self, dataset, split: str) -> TapsDataset:
        return TapsDataset(dataset, self.stores[split])


class TapsDataset(torch.utils.data.Dataset):
    """Rows of a (filtered) regenerated split plus their stored taps under ``target_taps`` (L, K*d)."""

    def __init__(self, dataset, store: FeatureStore):
        self.dataset, self.store = dataset, store

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        row = self.dataset[int(i)]
        taps = self.store.taps(int(row[ROW]))
        if taps.shape[0] != len(row["input_ids"]):  # the manifest matched, so only a damaged shard gets here
            raise DFlash2Error(
                f"stored features of row {row[ROW]} have {taps.shape[0]} tokens, the sequence "
                f"{len(row['input_ids'])}; remove {self.store.folder} and recompute it"
            )
        return {**row, "target_taps": taps}
