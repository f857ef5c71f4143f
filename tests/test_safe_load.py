"""No load executes code from a file (issue 12): every torch file the library reads is weights-only.

A crafted pickle whose unpickling would create a marker file is refused with one line by the
shared loader, the Trainer's checkpoint IO (its resume path), the target-build resume and the
regeneration shard store; the marker never appears. The export and ``train.py ckpt_path=``
entry points are tested in test_export.py and test_train_drafter.py."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from conftest import crafted_checkpoint

from dflash2.safe_load import UnsafeFileError, load_torch_file

REPO = Path(__file__).resolve().parents[1]
PLAIN = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 3, "meta": {"ids": [1, 2], "name": "x"}}


@pytest.mark.parametrize("how", ["touch", "shell"])
def test_a_crafted_file_is_refused_and_runs_nothing(tmp_path, how):
    marker = tmp_path / "pwned"
    path = crafted_checkpoint(tmp_path / "evil.ckpt", marker, PLAIN, how=how)
    with pytest.raises(UnsafeFileError, match=r"evil\.ckpt was not loaded: .*could run code") as err:
        load_torch_file(path)
    message = str(err.value)
    assert "\n" not in message and ("posix.system" in message if how == "shell" else "pathlib" in message)
    assert not marker.exists()


def test_a_legacy_non_zip_crafted_file_is_refused_too(tmp_path):
    # torch's pre-1.6 format, which get_unsafe_globals_in_checkpoint cannot scan: torch's message names the global
    marker = tmp_path / "pwned"
    path = crafted_checkpoint(tmp_path / "legacy.pt", marker, PLAIN, legacy=True)
    with pytest.raises(UnsafeFileError, match=r"legacy\.pt was not loaded: .*getattr"):
        load_torch_file(path)
    assert not marker.exists()


def test_plain_files_load_and_damaged_ones_are_not_called_unsafe(tmp_path):
    torch.save(PLAIN, tmp_path / "ok.pt")
    loaded = load_torch_file(tmp_path / "ok.pt", mmap=True)
    assert torch.equal(loaded["state_dict"]["w"], PLAIN["state_dict"]["w"]) and loaded["meta"] == PLAIN["meta"]
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    with pytest.raises(pickle.UnpicklingError, match=r"^not an intact torch file \(Unsupported operand") as err:
        load_torch_file(tmp_path / "notes.pt")
    assert not isinstance(err.value, UnsafeFileError) and "weights_only" not in str(err.value)


def test_the_trainer_resume_load_is_weights_only(tmp_path):
    """Lightning's ``fit(ckpt_path=...)`` reads through the strategy's CheckpointIO: ours refuses the file."""
    import lightning as L

    from dflash2.training.atomic_checkpoint_io import AtomicCheckpointIO

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Tiny()
    base = {"state_dict": module.state_dict(), "global_step": 1, "epoch": 0, "pytorch-lightning_version": L.__version__}
    marker = tmp_path / "pwned"
    crafted = crafted_checkpoint(tmp_path / "evil.ckpt", marker, base)
    io = AtomicCheckpointIO()
    with pytest.raises(UnsafeFileError, match="could run code"):
        io.load_checkpoint(crafted, weights_only=False)  # even when asked to load unsafely
    trainer = L.Trainer(
        max_steps=2,
        plugins=[AtomicCheckpointIO()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
    with pytest.raises(UnsafeFileError, match=r"evil\.ckpt was not loaded"):
        trainer.fit(module, train_dataloaders=loader, ckpt_path=crafted)
    assert not marker.exists()
    torch.save(base, tmp_path / "ok.ckpt")  # a plain checkpoint loads through the same IO
    assert io.load_checkpoint(tmp_path / "ok.ckpt")["global_step"] == 1


def test_a_crafted_target_build_checkpoint_is_ignored_not_run(tmp_path, caplog):
    from dflash2.training.build_target import _checkpoint_step

    marker = tmp_path / "pwned"
    crafted = crafted_checkpoint(tmp_path / "last.ckpt", marker, {"global_step": 4})
    assert _checkpoint_step(crafted) is None  # the build starts over and overwrites it
    assert any(m.startswith(f"ignoring unreadable target-build checkpoint {crafted} ") for m in caplog.messages)
    assert not marker.exists()


def test_a_crafted_regeneration_shard_is_discarded_not_run(tmp_path, caplog):
    from dflash2.data.shard_store import ShardStore

    store = ShardStore(tmp_path / "partial")
    store.folder.mkdir()
    marker = tmp_path / "pwned"
    prompt = torch.zeros(2, 3, dtype=torch.int64)
    base = {"index": 0, "prompt": prompt, "response": torch.zeros(2, 4, dtype=torch.int64)}
    crafted_checkpoint(store.path(0), marker, {**base, "generator_state": torch.Generator().get_state()})
    assert store.load([prompt], response_tokens=4) == []
    assert any(m.startswith(f"discarding unreadable regeneration shard {store.path(0)} ") for m in caplog.messages)
    assert not marker.exists()


def test_the_library_reads_torch_files_only_through_the_safe_loader():
    """A new ``torch.load`` elsewhere in dflash2/ would bypass the weights-only rule."""
    offenders = []
    for path in sorted((REPO / "dflash2").rglob("*.py")):
        text = path.read_text()
        if path.name != "safe_load.py" and re.search(r"torch\.load\(|\bpl_load\(|weights_only\s*=\s*False", text):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
