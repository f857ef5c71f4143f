"""The held-out report after training runs its forwards in the trainer's precision (train_drafter.py
``heldout_report(precision=trainer.precision_plugin.forward_context)``): under bf16-mixed that is bf16
autocast, the numerics and kernels training used (an fp32 flex compile there failed on the GPU)."""

from __future__ import annotations

import contextlib

import torch

from dflash2.training.drafter_module import DrafterTrainingModule
from dflash2.training.train_drafter import heldout_report

KW = dict(num_anchors=4, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.0)
KW.update(warmup_ratio=0.0, total_steps=10, seed=0)


def _rows(n: int, length: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (n, length), generator=g)
    return [{"input_ids": r.tolist(), "loss_mask": [0] * 6 + [1] * (length - 6)} for r in ids]


def test_every_forward_runs_inside_the_precision_context(make_spec_target, make_spec_drafter):
    target = make_spec_target("qwen3")
    module = DrafterTrainingModule(make_spec_drafter(target, 4, v2=True), target, **KW)
    seen = []  # per forward: whether bf16 autocast was on while block_outputs ran
    forward = module.block_outputs

    def recording(batch, generator):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return forward(batch, generator)

    module.block_outputs = recording
    entered = []

    @contextlib.contextmanager
    def bf16():
        entered.append(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield

    rows = _rows(5, 20)
    report = heldout_report(module, rows, rows, pad_id=0, batch_size=2, seed=0, precision=bf16)
    assert seen == [True, True, True] and len(entered) == 3  # 5 rows in batches of 2
    assert report["heldout_blocks"] > 0 and len(report["heldout_acc_per_position"]) == 3  # block 4: 3 drafts

    seen.clear()
    heldout_report(module, rows, rows, pad_id=0, batch_size=5, seed=0)  # default: no context, fp32
    assert seen == [False]
