"""On-disk format of offline target features (issue 15): a manifest plus safetensors shards.

One folder per regenerated split (``<cache>/features/<split>-<key>/``, named like the
split's dataset folder ``<cache>/data/<split>-<key>/``) holds

    manifest.json             what the features were computed from (see ``FeatureManifest``)
    shard-000003.safetensors  rows [3*R, 4*R) of the dataset, R = rows_per_shard:
        rows        (n,) int64       dataset row of each stored sequence, in order
        offsets     (n+1,) int64     token range of row i is [offsets[i], offsets[i+1])
        taps        (T, K*d)         target dtype; the concatenated outputs of the tapped layers
        next_ids    (T,) int32       argmax of the target's logits at each token (its greedy next token)
        top_ids     (T, k) int32     only when top_k > 0: the target's top-k next tokens, best first
        top_logits  (T, k)           target dtype, their logits

safetensors rather than Arrow (numbers in docs/TRAINING.md, ``python -m dflash2.data.features_bench``):
the taps are one dense (T, K*d) block per shard, which safetensors stores raw in any torch dtype
(bf16 included: Arrow has no bf16 type and would double the bytes as fp32) and reads back by
mmap, one row being a contiguous slice. Every shard is written to a temp name and renamed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash2.atomic_files import atomic_write_with
from dflash2.errors import DFlash2Error

FORMAT = "dflash2-features-v1"
MANIFEST = "manifest.json"


@dataclass
class FeatureManifest:
    """The identity of a feature folder. Every field but ``target_path`` and ``complete`` must match for a
    resume or a run to use it: another target (weights hash), dtype, taps, top-k, data set or sharding
    gives other bytes."""

    target: str  # dflash2.data.regenerate.target_fingerprint of the target folder
    # where it was loaded from, for messages only: a run reads a copy of the target (<run>/target/)
    target_path: str = field(compare=False)
    dtype: str  # 'float32', 'bfloat16', ... (dflash2.target_dtype.dtype_name)
    taps: list[int]  # target_layer_ids, in concatenation order
    hidden_size: int  # d of the target: a tap row is len(taps) * hidden_size wide
    top_k: int  # 0: no top_ids / top_logits
    data: str  # the regenerated split's folder name, '<split>-<key>' (the key hashes all its inputs)
    data_rows: int  # rows of that dataset
    rows_per_shard: int
    format: str = FORMAT
    complete: bool = field(default=False, compare=False)  # set once every shard is written

    @property
    def num_shards(self) -> int:
        return -(-self.data_rows // self.rows_per_shard)

    def differences(self, other: FeatureManifest) -> list[str]:
        """'field: ours vs theirs' for every identity field that differs (those compared by ``==``)."""
        mine, theirs = asdict(self), asdict(other)
        compared = [f.name for f in fields(self) if f.compare]
        return [f"{k}: {mine[k]} vs {theirs[k]}" for k in compared if mine[k] != theirs[k]]


def read_manifest(folder: Path) -> FeatureManifest | None:
    """The folder's manifest, or None when there is none; a damaged one is a one-line error."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        return FeatureManifest(**raw)
    except (ValueError, TypeError) as e:
        raise DFlash2Error(f"feature manifest {path} is damaged ({e}); remove the folder and recompute") from e


def write_manifest(folder: Path, manifest: FeatureManifest) -> None:
    text = json.dumps(asdict(manifest), indent=2) + "\n"
    atomic_write_with(Path(folder) / MANIFEST, lambda tmp: Path(tmp).write_text(text))


def shard_path(folder: Path, index: int) -> Path:
    return Path(folder) / f"shard-{index:06d}.safetensors"


def save_shard(folder: Path, index: int, tensors: dict[str, torch.Tensor]) -> None:
    """Write one shard (keys as in the module docstring) atomically."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    atomic_write_with(shard_path(folder, index), lambda tmp: save_file(tensors, str(tmp), {"index": str(index)}))


def shard_is_valid(folder: Path, index: int, rows: list[int], lengths: list[int], manifest: FeatureManifest) -> bool:
    """True when shard ``index`` exists, opens, and holds exactly ``rows`` with these token counts and widths:
    a rename is atomic, so a named shard is complete unless a foreign or older file sits under the name."""
    path = shard_path(folder, index)
    if not path.exists():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets")
            width, names = f.get_slice("taps").get_shape()[1], list(f.keys())
            ok = (
                f.get_tensor("rows").tolist() == list(rows)
                and (offsets[1:] - offsets[:-1]).tolist() == list(lengths)
                and width == len(manifest.taps) * manifest.hidden_size
                and ("top_ids" in names) == (manifest.top_k > 0)
            )
    except Exception:  # a truncated or foreign file: recompute the shard
        return False
    return ok


class FeatureStore:
    """Read access to a complete feature folder: ``taps(row)`` -> (L, K*d) in the stored dtype.

    Shards are opened lazily (safetensors mmap) and the handles dropped when pickled, so DataLoader
    workers open their own."""

    def __init__(self, folder: Path, manifest: FeatureManifest):
        self.folder, self.manifest = Path(folder), manifest
        self._where: dict[int, tuple[int, int, int]] = {}  # row -> (shard, start, end)
        for s in range(manifest.num_shards):
            with safe_open(str(shard_path(self.folder, s)), framework="pt") as f:
                rows, offsets = f.get_tensor("rows").tolist(), f.get_tensor("offsets").tolist()
            for i, row in enumerate(rows):
                self._where[row] = (s, offsets[i], offsets[i + 1])
        self._open: dict[int, object] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}

    def _handle(self, shard: int):
        if shard not in self._open:
            self._open[shard] = safe_open(str(shard_path(self.folder, shard)), framework="pt")
        return self._open[shard]

    def tensor(self, row: int, name: str = "taps") -> torch.Tensor:
        """The (L, ...) slice of ``name`` for one dataset row."""
        shard, start, end = self._where[row]
        return self._handle(shard).get_slice(name)[start:end]

    def taps(self, row: int) -> torch.Tensor:
        return self.tensor(row, "taps")
