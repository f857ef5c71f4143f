"""LightningModule that trains a drafter against a frozen target (issue 3, ARCHITECTURE.md §2.6, §3).

Each step: target taps for the batch under no_grad (online, or read from the batch with
data.features=offline; the target is frozen and never part of the optimised or checkpointed state),
anchors redrawn from an RNG keyed by (seed, step, row of the global batch), all blocks of a sequence
in one drafter forward with the block-sparse mask, decay-weighted CE plus the selector's loss.
Under DDP / FSDP each rank holds a slice of the global batch; the losses are normalised and the
logged metrics summed over the ranks, so both are those of the global batch
(dflash2/training/data_parallel.py).
"""

from __future__ import annotations

import time

import lightning as L
import torch

from dflash2.drafter.local_conv import set_conv_kernels
from dflash2.drafter.masks import FLEX_MIN_HEAD_DIM, uses_flex
from dflash2.drafter.model import set_norm_kernels
from dflash2.drafter.objective import (
    WeightTotal,
    anchor_generator,
    block_labels,
    block_metric_sums,
    block_metrics,
    metrics_from_sums,
    own_weight_total,
    position_weights,
    row_anchor_generator,
    sample_anchors,
    weighted_position_loss,
)
from dflash2.errors import DFlash2Error
from dflash2.training.batch_transfer import copies_beside_compute, copy_beside_compute
from dflash2.training.chunked_head import HeadOutputs, chunked_head_outputs, head_outputs_from_logits
from dflash2.training.data_parallel import all_reduce_sum, global_weight_share, world_size
from dflash2.training.optimizer_impl import adamw_kwargs, check_optimizer_impl, is_fused, resolve_optimizer_impl
from dflash2.training.param_groups import PARAM_ORDER, decay_runs, regroup_two_group_checkpoint
from dflash2.training.preflight import (
    check_attention,
    check_conv_kernels,
    check_loss_chunk_positions,
    check_loss_keep_logits,
    check_loss_kernels,
    check_loss_topk_kernel,
    check_norm_kernels,
    drafter_config_differences,
)
from dflash2.training.schedule import cosine_with_warmup


class DrafterTrainingModule(L.LightningModule):
    """Holds the trainable `drafter` (an nn.Module) and a reference to the frozen `target` (a TargetModel)."""

    def __init__(
        self,
        drafter: torch.nn.Module,
        target,
        *,
        num_anchors: int,
        loss_gamma: float,
        selector_loss_weight: float,
        lr: float,
        weight_decay: float,
        warmup_ratio: float,
        total_steps: int,
        seed: int,
        target_id: str = "",
        selector_gold_injection: bool = False,
        loss_chunk_positions: int = 0,
        loss_kernels: bool = False,
        conv_kernels: bool = False,
        norm_kernels: bool = False,
        loss_keep_logits: bool = False,
        loss_topk_kernel: bool = False,
        attention: str = "auto",
        optimizer_impl: str = "auto",
    ):
        super().__init__()
        # What `with_drafter` needs to build the same module around another drafter object.
        self._settings = dict(
            num_anchors=num_anchors,
            loss_gamma=loss_gamma,
            selector_loss_weight=selector_loss_weight,
            lr=lr,
            weight_decay=weight_decay,
            warmup_ratio=warmup_ratio,
            total_steps=total_steps,
            seed=seed,
            target_id=target_id,
            selector_gold_injection=selector_gold_injection,
            loss_chunk_positions=loss_chunk_positions,
            loss_kernels=loss_kernels,
            conv_kernels=conv_kernels,
            norm_kernels=norm_kernels,
            loss_keep_logits=loss_keep_logits,
            loss_topk_kernel=loss_topk_kernel,
            attention=attention,
            optimizer_impl=optimizer_impl,
        )
        self.drafter = drafter
        # Weight decay goes to matrices. Decided here, on the parameters as built: FSDP replaces them by
        # flat 1-D shards before configure_optimizers, where `ndim >= 2` would silently exempt them all.
        self._decayed = {name for name, p in drafter.named_parameters() if p.ndim >= 2}
        # Kept outside the module tree on purpose: its weights must not enter
        # checkpoints or the optimizer; `on_fit_start` moves it with us.
        object.__setattr__(self, "target", target)
        self.num_anchors, self.loss_gamma, self.selector_loss_weight = num_anchors, loss_gamma, selector_loss_weight
        self.lr, self.weight_decay, self.warmup_ratio, self.total_steps = lr, weight_decay, warmup_ratio, total_steps
        self.seed, self.target_id = seed, target_id
        self.selector_gold_injection = selector_gold_injection  # ARCHITECTURE.md §3.2
        # > 0: the loss through the LM head in chunks of that many positions (chunked_head.py); 0: the plain
        # path from full logits, kept as the reference (drafter.loss_chunk_positions, docs/TRAINING.md)
        self.loss_chunk_positions = check_loss_chunk_positions(loss_chunk_positions)
        # the chunked loss's passes over each chunk's logits as Triton kernels where they can run (no serving
        # scales, CUDA; chunked_head.use_fused_passes); no effect on the plain path (drafter.loss_kernels)
        self.loss_kernels = check_loss_kernels(loss_kernels)
        # the DFlash2 block-local conv's sides as Triton kernels where they run (CUDA; conv_kernels.py), set on
        # every conv of this drafter (drafter.conv_kernels); the torch code elsewhere and when off
        self.conv_kernels = check_conv_kernels(conv_kernels)
        # the chunked loss keeps each chunk's logits for backward instead of recomputing them there (one head
        # matmul per chunk fewer, M · V logits held through the step; drafter.loss_keep_logits)
        self.loss_keep_logits = check_loss_keep_logits(loss_keep_logits)
        # the chunked loss's top-k candidates through the runtime's Triton top-k where it runs (CUDA; the same
        # values, ties by the lower index; drafter.loss_topk_kernel); torch.topk elsewhere and when off
        self.loss_topk_kernel = check_loss_topk_kernel(loss_topk_kernel)
        set_conv_kernels(drafter, self.conv_kernels)
        # the drafter's RMSNorms' forward and backward as Triton kernels where they run (CUDA; norm_kernels.py),
        # set on every norm of this drafter (drafter.norm_kernels); rms_norm.py's torch code elsewhere and when off
        self.norm_kernels = check_norm_kernels(norm_kernels)
        set_norm_kernels(drafter, self.norm_kernels)
        # auto | flex | dense: the drafter's training attention, decided per step on the batch's device
        # (drafter.attention, docs/TRAINING.md "Block-sparse attention in training")
        self.attention = check_attention(attention)
        # auto | fused | foreach | for_loop: AdamW's implementation, resolved on the parameters' device when
        # the optimiser is built (drafter.optimizer_impl, dflash2/training/optimizer_impl.py)
        self.optimizer_impl = check_optimizer_impl(optimizer_impl)
        self._last_step_time: float | None = None
        self._copy_streams: dict = {}  # device -> the CUDA stream batches are copied on (batch_transfer.py)
        self.measured_tau_history: list[tuple[int, float]] = []  # filled by MeasuredTauCallback

    # ----------------------------------------------------------------- plumbing
    def _sync_target_device(self) -> None:
        if self.target.model.device != self.device:
            self.target.model.to(self.device)

    def on_fit_start(self) -> None:
        self._sync_target_device()

    def on_validation_start(self) -> None:
        self._sync_target_device()

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """Lightning's copy of a batch to the device, except for a pinned batch bound for a GPU
        (data.pin_memory): copied on a side stream, beside the previous step's kernels (batch_transfer.py)."""
        if copies_beside_compute(batch, device):
            return copy_beside_compute(batch, device, self._copy_streams)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    def with_drafter(self, drafter: torch.nn.Module) -> DrafterTrainingModule:
        """This module's settings and target around ``drafter`` (FSDP: a gathered, unsharded copy)."""
        return DrafterTrainingModule(drafter, self.target, **self._settings)

    # ---------------------------------------------------------------- the step
    def block_outputs(
        self,
        batch: dict,
        generator: torch.Generator | list[torch.Generator],
        weight_total: WeightTotal = own_weight_total,
    ) -> dict:
        """Forward of one batch: losses, predictions and labels. Shapes in comments.

        ``generator``: the anchors' RNG, one for the batch or one per row; ``weight_total``: the
        losses' normaliser (`dflash2.drafter.objective.WeightTotal`)."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # (N, L)
        # The target runs in its own dtype (target.dtype), outside the drafter's mixed-precision
        # autocast: the taps are then the ones it produces when served; the drafter casts them.
        taps = batch.get("target_taps")  # (N, L, K*d_t): stored by data.features=offline, else computed here
        if taps is None:
            with torch.no_grad(), torch.autocast(device_type=input_ids.device.type, enabled=False):
                taps = self.target.tap_features(input_ids)  # (N, L, K*d_t) in the target's dtype
        anchors, valid = sample_anchors(loss_mask, self.num_anchors, generator)  # (N, A)
        if not bool(valid.any()):
            raise DFlash2Error(
                "a batch has no eligible anchor (no two consecutive response tokens); "
                "check data.response_tokens and the loss mask"
            )
        head_dim = self.drafter.config.head_dim
        use_flex = uses_flex(self.attention, input_ids.device, head_dim)
        if use_flex and not input_ids.is_cuda and torch.is_grad_enabled():
            raise DFlash2Error(
                "drafter.attention=flex on the CPU: FlexAttention has no backward there; use drafter.attention=auto"
            )
        if use_flex and input_ids.is_cuda and head_dim < FLEX_MIN_HEAD_DIM:
            raise DFlash2Error(
                f"drafter.attention=flex with head_dim {head_dim}: torch's flex kernels need a head dim of at least "
                f"{FLEX_MIN_HEAD_DIM}; use drafter.attention=auto (dense for such heads)"
            )
        hidden = self.drafter.training_forward(
            taps, input_ids, self.target.embed_tokens, anchors, valid, use_flex=use_flex
        )  # (N, A, B, d)
        drafted = hidden[:, :, 1:]  # (N, A, P, d): block position k predicts token anchor + k
        labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, self.block_size)  # (N, A, P)
        selector = getattr(self.drafter, "candidate_selector", None)
        head = self.head_outputs(drafted, labels, selector.top_k if selector is not None else 0)
        weights = position_weights(self.block_size, self.loss_gamma, device=drafted.device)
        ce = weighted_position_loss(head.ce, label_mask, weights, weight_total)
        out = {"ce": ce, "loss": ce, "predictions": head.argmax, "labels": labels, "label_mask": label_mask}
        if selector is not None:
            anchor_ids = input_ids.gather(1, anchors)  # (N, A)
            flat = lambda t: t.flatten(0, 1)  # noqa: E731  (N, A, ...) -> (N*A, ...)
            # The selector reads only the top-k and the label's logit: no (N, A, P, V) tensor reaches it.
            top = flat(head.top_ids), flat(head.top_raw)  # (N*A, P, k) each
            sel_loss, sel_stats = selector.loss_from_top(
                flat(drafted),
                *top,
                flat(head.label_raw),
                flat(anchor_ids),
                flat(labels),
                flat(label_mask),
                inject_gold=self.selector_gold_injection,
                weight_total=weight_total,
            )
            out["selector_loss"], out["selector_stats"] = sel_loss, sel_stats
            out["loss"] = ce + self.selector_loss_weight * sel_loss
            path = selector.greedy_path_from_top(flat(drafted), *top, flat(anchor_ids))
            out["selector_predictions"] = path.view_as(labels)
        return out

    def head_outputs(self, drafted: torch.Tensor, labels: torch.Tensor, top_k: int) -> HeadOutputs:
        """Per-position CE, argmax, top-k and label logit of the drafter's logits (chunked_head.py).

        drafted (N, A, P, d), labels (N, A, P) -> HeadOutputs of leading shape (N, A, P). The CE is on the
        drafter's served logits (output multiplier / softcap, ARCHITECTURE.md §3.4), what T>0 samples
        from; argmax and the top-k are of the raw ones, which the selector scales itself, as engines do.
        """
        config = self.drafter.config
        if self.loss_chunk_positions:
            head = self.target.lm_head
            if not isinstance(head, torch.nn.Linear):  # the chunks are F.linear with its weight and bias
                raise DFlash2Error(
                    f"the target's lm_head is a {type(head).__name__}, not a Linear layer: the chunked loss "
                    "cannot recompute it; set drafter.loss_chunk_positions=0"
                )
            return chunked_head_outputs(
                drafted,
                head.weight,
                getattr(head, "bias", None),
                labels,
                chunk=self.loss_chunk_positions,
                top_k=top_k,
                multiplier=config.output_multiplier,
                softcap=config.final_logit_softcapping,
                fused=self.loss_kernels,
                keep_logits=self.loss_keep_logits,
                topk_kernel=self.loss_topk_kernel,
            )
        raw = self.target.head_logits(drafted)  # (N, A, P, V), drafted cast to the head's dtype
        logits = self.drafter.block_logits(drafted, self.target.head_logits, raw=raw)
        return head_outputs_from_logits(raw, logits, labels, top_k)

    def _log_block_metrics(self, prefix: str, out: dict, **kw) -> dict:
        metrics = block_metrics(out["predictions"], out["labels"], out["label_mask"])
        logs = {
            f"{prefix}/loss": out["loss"].detach(),
            f"{prefix}/ce": out["ce"].detach(),
            f"{prefix}/tau_estimate": metrics["tau_estimate"],
        }
        for k, a in enumerate(metrics["acc_per_position"], start=1):
            logs[f"{prefix}/acc_pos{k}"] = a
        if "selector_loss" in out:
            path_metrics = block_metrics(out["selector_predictions"], out["labels"], out["label_mask"])
            logs[f"{prefix}/selector_loss"] = out["selector_loss"].detach()
            logs[f"{prefix}/selector_tau_estimate"] = path_metrics["tau_estimate"]
            for name, value in out["selector_stats"].items():
                logs[f"{prefix}/selector_{name}"] = value
        self.log_dict(logs, **kw)
        return metrics

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # Each row's anchors from its own (seed, step, global row): the same on any rank (drafter_data.py).
        keys = batch["anchor_keys"].tolist()
        generators = [row_anchor_generator(self.seed, step, row) for step, row in keys]
        out = self.block_outputs(batch, generators, weight_total=global_weight_share)
        logs = self._global_train_logs(out, batch)
        if not torch.isfinite(logs["train/loss"]):  # the global loss: every rank stops together
            raise DFlash2Error(
                f"drafter loss became {logs['train/loss'].item()} at step {self.global_step}; "
                "training stopped and the last good checkpoint is kept under the run's checkpoints/ "
                "(resume with ckpt_path=last); lower drafter.lr or use fp32"
            )
        tokens = logs.pop("tokens")
        self.log_dict(logs, prog_bar=False)
        self.log("train/loss_bar", logs["train/loss"], prog_bar=True, logger=False)
        now = time.perf_counter()
        if self._last_step_time is not None:
            self.log("train/tokens_per_s", tokens / (now - self._last_step_time))
        self._last_step_time = now
        return out["loss"]

    def _global_train_logs(self, out: dict, batch: dict) -> dict:
        """The step's metrics over the global batch, as one process logs them: losses are means over
        ranks of the per-rank shares (data_parallel.py), accuracies and the τ estimate come from
        counts summed over ranks. One all-reduce of one vector (none with one process)."""
        parts = {
            "loss": out["loss"].detach().double()[None],
            "ce": out["ce"].detach().double()[None],
            "tokens": torch.tensor([float(batch["input_ids"].numel())], dtype=torch.float64, device=self.device),
            "counts": block_metric_sums(out["predictions"], out["labels"], out["label_mask"]),
        }
        if "selector_loss" in out:
            labelled = out["label_mask"].sum().double()
            stats = out["selector_stats"]  # ratios over this rank's labelled positions: weigh them back to sums
            parts["selector_loss"] = out["selector_loss"].detach().double()[None]
            parts["selector_counts"] = block_metric_sums(out["selector_predictions"], out["labels"], out["label_mask"])
            parts["selector_stats"] = torch.stack([stats[k].double() * labelled for k in sorted(stats)])
            parts["labelled"] = labelled[None]
        sizes = [t.numel() for t in parts.values()]
        flat = all_reduce_sum(torch.cat([t.to(self.device) for t in parts.values()]))
        summed = dict(zip(parts, flat.split(sizes)))
        world = world_size()
        metrics = metrics_from_sums(summed["counts"])
        logs = {
            "train/loss": (summed["loss"][0] / world).float(),
            "train/ce": (summed["ce"][0] / world).float(),
            "train/tau_estimate": metrics["tau_estimate"],
            "tokens": float(summed["tokens"][0]),
        }
        for k, a in enumerate(metrics["acc_per_position"], start=1):
            logs[f"train/acc_pos{k}"] = a
        if "selector_loss" in out:
            logs["train/selector_loss"] = (summed["selector_loss"][0] / world).float()
            logs["train/selector_tau_estimate"] = metrics_from_sums(summed["selector_counts"])["tau_estimate"]
            labelled = summed["labelled"][0].clamp_min(1.0)
            for name, value in zip(sorted(out["selector_stats"]), summed["selector_stats"]):
                logs[f"train/selector_{name}"] = (value / labelled).float()
        return logs

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        out = self.block_outputs(batch, anchor_generator(self.seed + 1, batch_idx))  # fixed anchors every validation
        # Every rank runs the whole validation split (drafter_data.py): the values are the same on every
        # rank, and rank 0's are logged as they are (no sync_dist: nothing to average).
        self._log_block_metrics("val", out, prog_bar=False, batch_size=batch["input_ids"].shape[0])

    # -------------------------------------------------------------- optimiser
    def configure_optimizers(self):
        named = dict(self._trainable())
        # Groups in the module's parameter order (param_groups.py: what FSDP's resume of a one-device
        # checkpoint assumes), decay on the matrices.
        groups = [
            {"params": [named[n] for n in run], "weight_decay": self.weight_decay if decays else 0.0}
            for decays, run in decay_runs(list(named), self._decayed)
        ]
        # Lightning builds the optimiser after moving the module to its device: the parameters' device is final.
        impl = resolve_optimizer_impl(self.optimizer_impl, list(named.values()), self._grad_scaler() is not None)
        optimizer = torch.optim.AdamW(
            groups,
            lr=self.lr,
            betas=(0.9, 0.95),
            **adamw_kwargs(impl),
        )
        scheduler = cosine_with_warmup(optimizer, int(self.warmup_ratio * self.total_steps), self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The drafter's trainable parameters by name, in module order (the optimizer's order)."""
        return [(n, p) for n, p in self.drafter.named_parameters() if p.requires_grad]

    def _grad_scaler(self):
        """The precision plugin's gradient scaler (16-mixed), or None (bf16-mixed, 32-true, no trainer)."""
        return getattr(getattr(self._trainer, "precision_plugin", None), "scaler", None)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping, except under FSDP: there each rank holds a shard of the gradients, so the
        norm must be taken over all shards by the FSDP root (`clip_grad_norm_`, a collective), and
        Lightning's FSDP precision plugin refuses norm clipping rather than clip each shard alone. And for a
        fused optimiser without a gradient scaler (drafter.optimizer_impl, optimizer_impl.py): Lightning's
        mixed-precision plugin refuses to clip for any fused optimiser, lest it clip scaled gradients, but
        bf16-mixed scales nothing; its base class clips them (the same call it makes after that check)."""
        from lightning.pytorch.plugins.precision import Precision
        from lightning.pytorch.strategies import FSDPStrategy
        from lightning.pytorch.utilities import GradClipAlgorithmType

        if not gradient_clip_val or not isinstance(self.trainer.strategy, FSDPStrategy):
            if gradient_clip_val and is_fused(optimizer) and self._grad_scaler() is None:
                algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
                Precision.clip_gradients(self.trainer.precision_plugin, optimizer, float(gradient_clip_val), algorithm)
                return
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise DFlash2Error(f"gradient_clip_algorithm={gradient_clip_algorithm} under FSDP: use norm clipping")
        self.trainer.strategy.model.clip_grad_norm_(float(gradient_clip_val))

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dflash2"] = {
            "drafter_config": self.drafter.config.to_dict(),
            "target_id": self.target_id,
            "param_order": PARAM_ORDER,  # the optimizer's groups in module order (param_groups.py)
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("dflash2", {}).get("drafter_config")
        if saved is None:
            return
        diff = drafter_config_differences(saved, self.drafter.config.to_dict())
        if diff:
            raise DFlash2Error(
                "checkpoint was trained with a different drafter/target setup ("
                + ", ".join(diff[:4])
                + "); resume with the same target and drafter config, or start a new run"
            )
        if checkpoint["dflash2"].get("param_order") != PARAM_ORDER:  # written with the older two groups
            regroup_two_group_checkpoint(checkpoint, [n for n, _ in self._trainable()], self._decayed)
