"""One learning-rate column per run (``lr-AdamW``), where Lightning's LearningRateMonitor writes one per group.

The drafter's optimizer has a group per run of parameters with the same weight decay, in module order
(param_groups.py): a few dozen groups for a deep drafter, all on one schedule with one rate. Lightning's
monitor would log ``lr-AdamW/pg1`` … ``lr-AdamW/pgN``, N equal columns. This logs the rate once, under
the name the monitor gave it when there were fewer groups, and says so if the groups ever disagree.
"""

from __future__ import annotations

import lightning as L

from dflash2.errors import DFlash2Error

NAME = "lr-AdamW"


class LearningRateLog(L.Callback):
    """Logs the optimizer's learning rate at each training step (before that step's update, as the monitor did)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not trainer.optimizers:
            return
        rates = {group["lr"] for group in trainer.optimizers[0].param_groups}
        if len(rates) != 1:
            raise DFlash2Error(
                f"the optimizer's parameter groups have {len(rates)} learning rates ({sorted(rates)}); "
                "dflash2's groups share one (param_groups.py), so one column logs it"
            )
        pl_module.log(NAME, rates.pop(), on_step=True, on_epoch=False)
