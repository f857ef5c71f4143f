"""Real τ during training (issue 4, item 3).

Every `every_n_validations` validation runs, decode a few validation prompts with
the *real* lossless speculative decoder (`dflash2.decoding`, T=0) against the frozen
target, and log the measured mean τ (`val/tau_measured`: tokens emitted by verify
steps / verify steps, the prefill's token excluded, a last step cut at EOS /
max_new_tokens counting only what it emitted; `SpecResult.mean_tau`) next to the
estimate from per-position accuracies (`val/tau_estimate`). The prompts are the
prompt parts of the regenerated validation sequences, never the held-out-eval split.

Cost on the embedded tiny pair (CPU, 4 prompts × 64 tokens): about a second
per call, so it is on by default.

Multi-process runs: global rank 0 decodes, with the whole drafter (under FSDP a copy gathered from
the shards: dflash2/training/full_drafter.py), and logs; the other ranks go on and wait for it at
the next step's first collective. Decoding on every rank would give the same number W times.
"""

from __future__ import annotations

import time

import lightning as L
import torch

from dflash2.decoding import speculative_generate
from dflash2.training.full_drafter import drafter_on_rank_zero


class MeasuredTauCallback(L.Callback):
    def __init__(self, every_n_validations: int = 1, num_prompts: int = 4, max_new_tokens: int = 64):
        self.every, self.num_prompts, self.max_new_tokens = max(1, every_n_validations), num_prompts, max_new_tokens
        self._validations = 0

    def _prompts(self, trainer) -> list[list[int]]:
        dataset = trainer.datamodule.val_dataset
        rows = [dataset[i] for i in range(min(self.num_prompts, len(dataset)))]
        return [r["input_ids"][: r["prompt_len"]] for r in rows]

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer: L.Trainer, module) -> None:
        if trainer.sanity_checking or getattr(trainer, "fast_dev_run", False):
            return
        self._validations += 1
        if (self._validations - 1) % self.every:
            return
        prompts = self._prompts(trainer)
        if not prompts:
            return
        drafter = drafter_on_rank_zero(trainer, module)  # every rank calls it: FSDP gathers
        if drafter is None:
            return
        target = module.target
        drafter = drafter.to(module.device)  # a gathered FSDP copy comes on the CPU; otherwise a no-op
        was_training = drafter.training
        drafter.eval()
        tokenizer = target.tokenizer
        started = time.perf_counter()
        with torch.autocast(device_type=module.device.type, enabled=False):
            result = speculative_generate(
                target,
                drafter,
                prompts,
                max_new_tokens=self.max_new_tokens,
                temperature=0.0,
                eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
            )
        drafter.train(was_training)
        # Logged through the module in this hook so it lands in the same row as val/tau_estimate.
        module.log("val/tau_measured", float(result.mean_tau))
        module.log("val/tau_measured_seconds", time.perf_counter() - started)
        module.measured_tau_history.append((trainer.global_step, float(result.mean_tau)))
