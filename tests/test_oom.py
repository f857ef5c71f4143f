"""Out-of-memory errors become one line with the run's own knobs (issue 6, dflash2/oom.py)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dflash2.errors import DFlash2Error
from dflash2.oom import TRAINING_KNOBS, explain_oom, knob_hints


def test_knob_hints_show_the_current_values_of_the_knobs_that_exist():
    cfg = OmegaConf.create({"data": {"batch_size": 8, "response_tokens": 128}, "drafter": {"num_anchors": 32}})
    assert knob_hints(cfg, TRAINING_KNOBS) == [
        "data.batch_size=8",
        "drafter.num_anchors=32",
        "data.response_tokens=128",
    ]


def test_other_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="not memory"), explain_oom("training", ["data.batch_size=8"]):
        raise ValueError("not memory")


@pytest.mark.cuda
def test_a_real_cuda_allocation_failure_is_explained():
    """On the GPU: an impossible allocation (1 PiB) raises the class explain_oom catches, and the cache is released."""
    with (
        pytest.raises(
            DFlash2Error, match=r"^out of GPU memory during drafter training; lower one of data.batch_size=8, or free"
        ) as err,
        explain_oom("drafter training", ["data.batch_size=8"]),
    ):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert isinstance(err.value.__cause__, torch.cuda.OutOfMemoryError)
    torch.ones(16, device="cuda")  # the device is still usable afterwards


def test_training_names_the_loss_chunk_when_on_and_advises_it_when_off():
    from dflash2.oom import oom_message
    from dflash2.training.train_drafter import training_oom_hints

    cfg = OmegaConf.create({"data": {"batch_size": 8}})
    on = oom_message("drafter training", *training_oom_hints(cfg, 512))
    assert "lower one of data.batch_size=8, drafter.loss_chunk_positions=512 (or set trainer.precision" in on
    off = oom_message("drafter training", *training_oom_hints(cfg, 0))
    assert "lower one of data.batch_size=8 (or set drafter.loss_chunk_positions=1024, set trainer.precision" in off
