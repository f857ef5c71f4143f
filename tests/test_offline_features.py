"""Offline target features (issue 15): `python -m dflash2.data.features` stores what the online
path computes, resumes after a kill to the same shards, refuses other inputs, and training from
them (data.features=offline) gives the online losses."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from dflash2.data.feature_shards import FeatureStore, read_manifest, shard_path
from dflash2.data.features import compute_features
from dflash2.errors import DFlash2Error


@pytest.fixture(scope="module")
def split(tmp_path_factory, make_spec_target):
    """A hybrid spec target (taps [0, 1]) and a saved 'regenerated' split of 7 rows in 3 lengths."""
    import datasets

    target = make_spec_target("qwen3_5")
    g = torch.Generator().manual_seed(0)
    lengths = [12, 9, 12, 5, 9, 12, 5]
    rows = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in lengths]
    folder = tmp_path_factory.mktemp("cache") / "data" / "train-0123456789abcdef"
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]})
    dataset.save_to_disk(str(folder))
    return target, datasets.load_from_disk(str(folder)), folder


def _compute(target, dataset, out: Path, **kw):
    kw = {"target_id": "spec", "data_name": "train-0123456789abcdef", "rows_per_shard": 3, "batch_size": 2, **kw}
    return compute_features(target, dataset, out, **kw)


def test_stored_taps_and_next_tokens_equal_the_online_ones(split, tmp_path):
    target, dataset, _ = split
    # One sequence per forward: the reference GDN kernel's rounding depends on the batch (3e-7 in fp32),
    # so bit equality holds against a forward of the same batch; training compares losses (below).
    manifest = _compute(target, dataset, tmp_path / "f", top_k=3, batch_size=1)
    assert manifest.complete and manifest.num_shards == 3
    store = FeatureStore(tmp_path / "f", read_manifest(tmp_path / "f"))
    for row, ids in enumerate(dataset["input_ids"]):
        ids = torch.tensor([ids])  # (1, L)
        online = target.tap_features(ids)[0]  # (L, K*d): what the training step computes
        assert store.taps(row).dtype == torch.float32
        assert torch.equal(store.taps(row), online), row
        logits = target(ids).logits[0]
        assert torch.equal(store.tensor(row, "next_ids"), logits.argmax(-1).to(torch.int32))
        assert torch.equal(store.tensor(row, "top_logits"), logits.topk(3).values)


def test_a_killed_job_resumes_to_the_same_shards(split, tmp_path):
    target, dataset, _ = split
    _compute(target, dataset, tmp_path / "whole")
    partial = _compute(target, dataset, tmp_path / "resumed", max_shards=1)  # "killed" after one shard
    assert not partial.complete and not read_manifest(tmp_path / "resumed").complete
    assert [shard_path(tmp_path / "resumed", s).exists() for s in range(3)] == [True, False, False]
    first = shard_path(tmp_path / "resumed", 0).stat().st_mtime_ns
    (tmp_path / "resumed" / ".shard-000001.safetensors.1.x.tmp").write_bytes(b"half a write")
    assert _compute(target, dataset, tmp_path / "resumed").complete
    assert shard_path(tmp_path / "resumed", 0).stat().st_mtime_ns == first  # kept, not recomputed
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir()
    )
    for s in range(3):
        assert shard_path(tmp_path / "resumed", s).read_bytes() == shard_path(tmp_path / "whole", s).read_bytes()


def test_a_damaged_shard_is_recomputed(split, tmp_path):
    target, dataset, _ = split
    _compute(target, dataset, tmp_path / "f")
    good = shard_path(tmp_path / "f", 1).read_bytes()
    shard_path(tmp_path / "f", 1).write_bytes(good[: len(good) // 2])
    _compute(target, dataset, tmp_path / "f")
    assert shard_path(tmp_path / "f", 1).read_bytes() == good


def test_a_folder_of_other_inputs_is_refused_in_one_line(split, tmp_path):
    from dflash2.target import TargetModel

    target, dataset, _ = split
    _compute(target, dataset, tmp_path / "f", max_shards=1)
    with pytest.raises(DFlash2Error, match="taps") as err:
        _compute(TargetModel(target.model, target_layer_ids=[1]), dataset, tmp_path / "f")
    assert "\n" not in str(err.value)
    with pytest.raises(DFlash2Error, match="data_rows"):
        _compute(target, dataset.select(range(4)), tmp_path / "f")


def test_the_cli_writes_beside_the_cache_and_rejects_bad_arguments(micro_target_dir, tmp_path):
    import datasets

    from dflash2.data.features import run

    folder = tmp_path / "cache" / "data" / "validation-feedfeedfeedfeed"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6, 7]]}).save_to_disk(str(folder))
    args = ["--target", str(micro_target_dir), "--data", str(folder), "--taps", "0,2", "--dtype", "fp32"]
    assert run([*args, "--device", "cpu"]) == 0
    manifest = read_manifest(tmp_path / "cache" / "features" / folder.name)
    assert manifest.complete and manifest.taps == [0, 2] and manifest.dtype == "float32"
    with pytest.raises(DFlash2Error, match="--taps"):
        run([*args[:-4], "--taps", "a,b"])
    with pytest.raises(DFlash2Error, match="task=data"):
        run(["--target", str(micro_target_dir), "--data", str(tmp_path)])


# ------------------------------------------------------------------ training from the features
def _losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as fh:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(fh) if r.get("train/loss")}


@pytest.mark.slow
def test_training_from_offline_features_matches_online(tmp_path, micro_train_overrides, micro_target_dir, monkeypatch):
    from test_train_drafter import compose_run

    from dflash2.data.features import run
    from dflash2.training.run import run_from_config

    short = [*micro_train_overrides, "trainer.max_steps=3", "heldout_tau.num_prompts=1"]
    cache = next(o.split("=", 1)[1] for o in micro_train_overrides if o.startswith("paths.cache_dir="))
    short = [o for o in short if not o.startswith("paths.cache_dir=")]

    def compose(extra: list[str], name: str):
        return compose_run(tmp_path, [*short, *extra, f"paths.cache_dir={cache}"], name)

    run_from_config(compose([], "online"))
    data = sorted((Path(cache) / "data").glob("[tv]*-*"))
    data = [d for d in data if d.name.split("-")[0] in ("train", "validation")]
    taps = ["--taps", "0,1,2", "--dtype", "fp32", "--device", "cpu"]
    # with no features yet: one line naming the command to run
    with pytest.raises(DFlash2Error, match=r"python -m dflash2\.data\.features") as err:
        run_from_config(compose(["data.features=offline", f"data.features_dir={tmp_path / 'feat'}"], "none"))
    assert "\n" not in str(err.value)
    assert run(["--target", str(micro_target_dir), "--data", *map(str, data), *taps, "--rows-per-shard", "7"]) == 0

    from dflash2.training.drafter_module import DrafterTrainingModule

    seen, step = [], DrafterTrainingModule.training_step

    def recording_step(self, batch, batch_idx):  # the offline run's batches carry the stored taps
        seen.append("target_taps" in batch)
        return step(self, batch, batch_idx)

    monkeypatch.setattr(DrafterTrainingModule, "training_step", recording_step)
    run_from_config(compose(["data.features=offline"], "offline"))
    assert seen == [True] * 3
    online, offline = _losses(tmp_path / "online"), _losses(tmp_path / "offline")
    assert sorted(online) == sorted(offline) == [0, 1, 2]
    for step in online:
        assert offline[step] == pytest.approx(online[step], rel=1e-5, abs=1e-6), step

    # other taps than the stored ones: refused in one line, nothing trained
    with pytest.raises(DFlash2Error, match=r"do not match this run.*taps") as err:
        run_from_config(compose(["data.features=offline", "target.target_layer_ids=[0,2]"], "other_taps"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "other_taps" / "drafter").exists()


@pytest.mark.parametrize("data", ["stdlib", "chat"])
def test_features_default_to_online_in_every_data_config(data, tmp_path):
    from test_configs import _compose

    from dflash2.training.offline_features import features_mode

    cfg = _compose([f"data={data}"], tmp_path)
    assert features_mode(cfg.data) == "online" and cfg.data.features_dir is None
    assert features_mode(_compose([f"data={data}", "data.features=offline"], tmp_path).data) == "offline"
    with pytest.raises(DFlash2Error, match="online"):
        features_mode({"features": "offlne"})
