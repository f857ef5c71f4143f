"""One training step of ``bench_throughput`` as Lightning runs it, and its timing."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from dflash2.training.chunked_head import use_fused_passes
from dflash2.training.optimizer_impl import optimizer_impl_name
from dflash2.training.throughput_report import top_kernels
from dflash2.training.throughput_setup import Bench, Variant


class StepRunner:
    """One variant's training module, optimiser and scheduler; ``step`` is one optimizer step as
    Lightning's automatic optimisation runs it (bench_throughput's docstring)."""

    def __init__(self, bench: Bench, variant: Variant, total_steps: int):
        from dflash2.training.preflight import check_attention
        from dflash2.training.train_drafter import training_module

        attention = check_attention(variant.attention, str(bench.device))  # flex on the CPU: refused, as train.py
        self.bench, self.device = bench, bench.device
        bench.drafter.load_state_dict(bench.initial_state)  # every row from the same weights
        self.module = training_module(
            bench.drafter,
            bench.target,
            bench.settings,
            total_steps=total_steps,
            seed=bench.seed,
            target_id=str(bench.target.name_or_path),
            loss_chunk=bench.chunk if variant.ce == "chunked" else 0,
            attention=attention,
        ).to(self.device)
        self.module.train()
        opt = self.module.configure_optimizers()
        self.optimizer, self.scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.clip = float(bench.settings.get("grad_clip") or 0.0)
        self.optimizer_impl = optimizer_impl_name(self.optimizer)
        # drafter.conv_kernels as it applies here: the conv's sides run as Triton kernels (conv_kernels.py)
        from dflash2.drafter.conv_kernels import conv_kernels_run

        self.conv_kernels = self.module.conv_kernels and conv_kernels_run(bench.drafter, self.device)
        # drafter.norm_kernels likewise: the RMSNorms run as Triton kernels (norm_kernels.py)
        from dflash2.drafter.norm_kernels import norm_kernels_run

        self.norm_kernels = self.module.norm_kernels and norm_kernels_run(bench.drafter, self.device)
        # drafter.loss_keep_logits as it applies here: only the chunked loss keeps logits
        self.loss_keep_logits = bool(self.module.loss_chunk_positions) and self.module.loss_keep_logits
        # drafter.loss_topk_kernel as it applies here: the chunked loss, where Triton runs
        from dflash2.runtime.kernels import use_triton

        self.loss_topk_kernel = (
            bool(self.module.loss_chunk_positions)
            and self.module.loss_topk_kernel
            and use_triton(torch.empty(0, device=self.device))
        )
        # drafter.loss_kernels as it applies here: the chunked CE's Triton passes run (chunked_head.py)
        self.loss_kernels = bool(self.module.loss_chunk_positions) and use_fused_passes(
            self.module.loss_kernels,
            torch.empty(0, device=self.device),
            bench.drafter.config.output_multiplier,
            bench.drafter.config.final_logit_softcapping,
        )
        # trainer=gpu is bf16-mixed: Lightning's own autocast around training_step (its weight-cast cache
        # off, as Lightning has it); trainer=cpu 32-true
        cuda = self.device.type == "cuda"
        self.autocast = MixedPrecision("bf16-mixed", "cuda").forward_context if cuda else nullcontext
        self.cpu_batch = bench.batches[variant.features]
        self.pinned = bench.pinned

    def step(self, step: int) -> None:
        rows = self.cpu_batch["input_ids"].shape[0]
        keys = torch.tensor([[step, r] for r in range(rows)], dtype=torch.long)  # (N, 2): (step, global row)
        if self.pinned:  # what the loader's pinning does with every batch (not timed there: a loader thread)
            keys = keys.pin_memory()
        # Lightning's batch transfer: the module's hook (a pinned batch goes on a side stream, batch_transfer.py)
        batch = self.module.transfer_batch_to_device({**self.cpu_batch, "anchor_keys": keys}, self.device, 0)
        with self.autocast():
            loss = self.module.training_step(batch, step)
        self.optimizer.zero_grad(set_to_none=True)  # Lightning zeroes after training_step, before backward
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.scheduler.step()

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # no gradients of this row in the next one's memory
        self.module = self.optimizer = self.scheduler = self.params = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_seconds(run, device: torch.device) -> float:
    """Wall time of ``run()``: CUDA events on a GPU, perf_counter after a synchronize elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    synchronize(device)
    t0 = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - t0


def compiled_graphs() -> int:
    """Graphs torch.compile has built so far in this process (flex attention and its block masks)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def profile_one_step(
    runner: StepRunner, step: int, device: torch.device, top: int = 10, trace: str | None = None
) -> dict:
    """torch.profiler over one more step: its ``top`` CUDA kernels and operators (CPU operators on the
    CPU); ``trace``: also write the step's Chrome trace there (gzipped when the name ends in .gz)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        runner.step(step)
        synchronize(device)
        wall = time.perf_counter() - t0
    result = {**top_kernels(prof, device.type, limit=top), "step_ms": wall * 1e3}
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
        result["trace"] = str(trace)
    return result
