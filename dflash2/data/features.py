"""`python -m dflash2.data.features`: compute the target's features of regenerated data once (issue 15).

Online training runs a full target forward every step only to read its taps; a run that
trains several drafters (seeds, variants, epochs) on one data set pays it again each time.
This job runs the target once over every sequence of a regenerated split and stores, per
token, the concatenated taps, the target's greedy next token and optionally its top-k
(format: ``feature_shards``). ``data.features=offline`` then trains from them.

    python -m dflash2.data.features --target <run>/target --data <cache>/data/train-<key> \\
        <cache>/data/validation-<key> --taps 1,9,17,25,33 --dtype bf16

It writes ``<cache>/features/<split>-<key>/`` (``--out`` changes the root), one shard of
``--rows-per-shard`` rows at a time; rerunning the same command after a kill skips the
finished shards, and a folder made from other inputs is refused.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash2.data.feature_shards import (
    FeatureManifest,
    read_manifest,
    save_shard,
    shard_is_valid,
    write_manifest,
)
from dflash2.data.regenerate import target_fingerprint
from dflash2.errors import DFlash2Error
from dflash2.target_dtype import dtype_name

log = logging.getLogger(__name__)


def features_root_for(data_dir: Path) -> Path:
    """Default root of a regenerated split's features: ``<cache>/features`` beside ``<cache>/data``."""
    return Path(data_dir).resolve().parent.parent / "features"


def manifest_for(target, dataset, *, target_id: str, data_name: str, top_k: int, rows_per_shard: int):
    """The manifest that features of ``dataset`` under ``target`` (a TargetModel) must carry."""
    return FeatureManifest(
        target=target_fingerprint(target_id),
        target_path=str(target_id),
        dtype=dtype_name(target.dtype),
        taps=list(target.target_layer_ids),
        hidden_size=int(target.hidden_size),
        top_k=int(top_k),
        data=data_name,
        data_rows=len(dataset),
        rows_per_shard=int(rows_per_shard),
    )


@torch.no_grad()
def sequence_features(target, input_ids: list[list[int]], top_k: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Per sequence {taps (L, K*d), next_ids (L,) int32[, top_ids (L, k) int32, top_logits (L, k)]} on the CPU.

    Sequences of one length are batched together (up to ``batch_size``), so no sequence is ever
    padded: its features are those of the sequence alone, whatever else is in the shard.
    """
    device = next(target.model.parameters()).device
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(input_ids):
        by_length[len(ids)].append(i)
    out: list[dict | None] = [None] * len(input_ids)
    for members in by_length.values():
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            ids = torch.tensor([input_ids[i] for i in chunk], dtype=torch.long, device=device)  # (n, L)
            result = target(ids)  # logits (n, L, V), taps (n, L, K*d), in the target's dtype
            next_ids = result.logits.argmax(-1).to(torch.int32)  # (n, L)
            top = result.logits.topk(top_k, dim=-1) if top_k else None
            for j, i in enumerate(chunk):
                feats = {"taps": result.taps[j].cpu(), "next_ids": next_ids[j].cpu()}
                if top is not None:
                    feats["top_ids"] = top.indices[j].to(torch.int32).cpu()
                    feats["top_logits"] = top.values[j].cpu()
                out[i] = feats
    return out  # type: ignore[return-value]


def compute_features(
    target,
    dataset,
    folder: Path,
    *,
    target_id: str,
    data_name: str,
    top_k: int = 0,
    rows_per_shard: int = 256,
    batch_size: int = 8,
    max_shards: int | None = None,
) -> FeatureManifest:
    """Write (or finish) the feature folder of ``dataset`` (a ``datasets.Dataset`` with ``input_ids``).

    Shards already present and valid are kept; a folder whose manifest names other inputs is refused.
    ``max_shards``: stop after computing that many new shards (a piece of the work now; the rest on
    a rerun). Returns the manifest, ``complete`` once every shard exists.
    """
    folder = Path(folder)
    manifest = manifest_for(
        target, dataset, target_id=target_id, data_name=data_name, top_k=top_k, rows_per_shard=rows_per_shard
    )
    existing = read_manifest(folder)
    if existing is not None and existing != manifest:
        raise DFlash2Error(
            f"{folder} holds features of other inputs ({'; '.join(existing.differences(manifest)[:3])}); "
            "remove it or pass another --out"
        )
    for stray in folder.glob(".*.tmp") if folder.is_dir() else []:
        stray.unlink(missing_ok=True)  # the temp file of a killed write
    if existing is None:
        write_manifest(folder, manifest)
    n = len(dataset)
    shards = [range(s * rows_per_shard, min((s + 1) * rows_per_shard, n)) for s in range(manifest.num_shards)]
    todo = []
    for s, rows in enumerate(shards):
        lengths = [len(ids) for ids in dataset[rows.start : rows.stop]["input_ids"]]
        if not shard_is_valid(folder, s, list(rows), lengths, manifest):
            todo.append(s)
    if len(todo) < len(shards):
        log.info(f"features of {data_name}: resuming, {len(shards) - len(todo)}/{len(shards)} shards already done")
    computed = 0
    bar = tqdm(total=len(shards), initial=len(shards) - len(todo), desc=f"features {data_name}", unit="shard")
    for s in todo:
        if max_shards is not None and computed >= max_shards:
            break
        rows = shards[s]
        input_ids = dataset[rows.start : rows.stop]["input_ids"]
        per_row = sequence_features(target, input_ids, top_k, batch_size)
        lengths = torch.tensor([0] + [len(ids) for ids in input_ids], dtype=torch.int64)
        tensors = {
            "rows": torch.arange(rows.start, rows.stop, dtype=torch.int64),
            "offsets": lengths.cumsum(0),
            **{name: torch.cat([f[name] for f in per_row]) for name in per_row[0]},
        }
        save_shard(folder, s, tensors)
        computed += 1
        bar.update(1)
    bar.close()
    if computed == len(todo):
        manifest.complete = True
        write_manifest(folder, manifest)
    return manifest


# ----------------------------------------------------------------- CLI
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dflash2.data.features",
        description="Compute the target's tapped hidden states (and next-token ids / top-k) of regenerated "
        "splits once, for data.features=offline (docs/TRAINING.md, 'Offline target features').",
    )
    parser.add_argument("--target", required=True, help="the target folder (e.g. <run>/target)")
    parser.add_argument(
        "--data", required=True, nargs="+", type=Path, help="regenerated split folders, <cache>/data/<split>-<key>"
    )
    parser.add_argument("--out", type=Path, help="features root (default <cache>/features beside <cache>/data)")
    parser.add_argument("--taps", help="comma-separated target layer ids (target.target_layer_ids of the run)")
    parser.add_argument("--num-taps", type=int, default=5, help="without --taps: the default spread of this many")
    parser.add_argument("--dtype", default="auto", help="the run's target.dtype (auto: bf16 on a GPU, else fp32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top-k", type=int, default=0, help="also store the target's top-k next tokens (0: none)")
    parser.add_argument("--rows-per-shard", type=int, default=256, help="sequences per shard (the unit of resume)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    parser.add_argument("--max-shards", type=int, help="stop after this many new shards (rerun to continue)")
    a = parser.parse_args(argv)
    for name in ("rows_per_shard", "batch_size", "num_taps"):
        if getattr(a, name) < 1:
            raise DFlash2Error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.top_k < 0:
        raise DFlash2Error(f"--top-k={a.top_k} must be >= 0")
    if a.taps is not None:
        try:
            a.taps = [int(x) for x in a.taps.split(",") if x.strip()]
        except ValueError:
            raise DFlash2Error(f"--taps={a.taps!r}: expected comma-separated layer ids, e.g. --taps 1,9,17") from None
    return a


def run(argv: list[str]) -> int:
    import datasets

    from dflash2.target import TargetModel
    from dflash2.target_dtype import resolve_target_dtype

    a = parse_args(argv)
    for d in a.data:
        if not (d / "dataset_info.json").exists():
            raise DFlash2Error(f"{d} is not a regenerated split folder (<cache>/data/<split>-<key>); run task=data")
    target = TargetModel.from_pretrained(
        a.target,
        target_layer_ids=a.taps,
        num_taps=a.num_taps,
        dtype=resolve_target_dtype(a.dtype, a.device),
        device=a.device,
    )
    incomplete = 0
    for d in a.data:
        root = a.out if a.out is not None else features_root_for(d)
        manifest = compute_features(
            target,
            datasets.load_from_disk(str(d)),
            root / d.name,
            target_id=a.target,
            data_name=d.name,
            top_k=a.top_k,
            rows_per_shard=a.rows_per_shard,
            batch_size=a.batch_size,
            max_shards=a.max_shards,
        )
        state = "complete" if manifest.complete else "partial (rerun to continue)"
        log.info(f"features of {d.name}: {state} in {root / d.name}")
        incomplete += not manifest.complete
    return 0 if not incomplete else 3


def main() -> None:
    from dflash2.logging_setup import configure_console_logging

    configure_console_logging()
    try:
        sys.exit(run(sys.argv[1:]))
    except DFlash2Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
