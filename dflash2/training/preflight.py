"""Checks a drafter run makes before it spends time on data or training (issue 6).

Each raises a one-line DFlash2Error naming the setting and the fix, so a bad
combination fails in seconds instead of after regeneration, or (worse) trains
quietly on blocks that can never be supervised.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash2.drafter.config import DrafterConfig
from dflash2.drafter.folder_check import check_drafter_folder
from dflash2.drafter.masks import ATTENTION_MODES
from dflash2.errors import DFlash2Error
from dflash2.safe_load import UnsafeFileError, load_torch_file


def check_loss_chunk_positions(value) -> int:
    """``drafter.loss_chunk_positions`` as an int >= 0 (null = 0: the plain loss from full logits)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DFlash2Error(
            f"drafter.loss_chunk_positions={value!r} must be an integer >= 0 "
            "(positions per chunk of the loss through the LM head; 0 = the plain loss from full logits)"
        )
    return value


def _check_switch(key: str, value, what: str) -> bool:
    """A ``drafter.<key>`` on/off switch as a bool (null = false), or a one-line error saying what it does."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise DFlash2Error(f"drafter.{key}={value!r} must be true or false ({what})")
    return value


def check_loss_kernels(value) -> bool:
    """``drafter.loss_kernels`` as a bool (null = false: the chunked CE's torch passes)."""
    return _check_switch("loss_kernels", value, "the chunked loss's passes over each chunk's logits as Triton kernels")


def check_loss_keep_logits(value) -> bool:
    """``drafter.loss_keep_logits`` as a bool (null = false: the chunked loss recomputes each chunk's logits)."""
    return _check_switch(
        "loss_keep_logits", value, "the chunked loss's logits kept from forward to backward instead of recomputed"
    )


def check_conv_kernels(value) -> bool:
    """``drafter.conv_kernels`` as a bool (null = false: the block-local conv's torch code)."""
    return _check_switch("conv_kernels", value, "the DFlash2 block-local conv's forward and backward as Triton kernels")


def check_loss_topk_kernel(value) -> bool:
    """``drafter.loss_topk_kernel`` as a bool (null = false: the selector's candidates through ``torch.topk``)."""
    return _check_switch(
        "loss_topk_kernel", value, "the chunked loss's top-k candidates through the two-stage Triton top-k"
    )


def check_norm_kernels(value) -> bool:
    """``drafter.norm_kernels`` as a bool (null = false: the RMSNorm's torch code, rms_norm.py)."""
    return _check_switch("norm_kernels", value, "the drafter's RMSNorm forward and backward as Triton kernels")


def check_attention(value, device: str | None = None) -> str:
    """``drafter.attention`` (auto | flex | dense; null = auto) as a string.

    ``device``: the run's training device when known: flex on the CPU fails here, before
    any data is made, rather than at the first backward (CPU FlexAttention has none)."""
    mode = "auto" if value is None else value
    if mode not in ATTENTION_MODES:
        raise DFlash2Error(
            f"drafter.attention={value!r} must be one of {', '.join(ATTENTION_MODES)} "
            "(auto: block-sparse FlexAttention on CUDA, the dense mask elsewhere)"
        )
    if mode == "flex" and device is not None and torch.device(device).type == "cpu":
        raise DFlash2Error(
            "drafter.attention=flex on the CPU: FlexAttention has no backward there; "
            "use drafter.attention=auto (dense on the CPU) or train on a GPU"
        )
    return mode


def check_blocks_fit_the_data(config: DrafterConfig, num_anchors: int, data: dict) -> None:
    """A block drafts ``block_size - 1`` tokens after an anchor inside one response.

    data: the plain ``data`` config group. An anchor needs itself and the next
    token in the response, so a response of R tokens has at most R - 1 anchor
    positions, and positions k > R - 1 of a block are never labelled.
    """
    response = int(data["response_tokens"])
    if num_anchors < 1:
        raise DFlash2Error(f"drafter.num_anchors={num_anchors} must be >= 1 (blocks per training sequence)")
    if config.block_size > response:
        raise DFlash2Error(
            f"drafter.block_size={config.block_size} is larger than data.response_tokens={response}: "
            "block positions past the response would never be trained; "
            f"raise data.response_tokens to >= {config.block_size} or lower drafter.block_size"
        )
    if num_anchors > response - 1:
        raise DFlash2Error(
            f"drafter.num_anchors={num_anchors} but a sequence of data.response_tokens={response} "
            f"has at most {response - 1} anchor positions; "
            f"lower drafter.num_anchors to <= {response - 1} or raise data.response_tokens"
        )


def check_sequences_fit_the_context(data: dict, max_positions: int | None) -> None:
    """Prompt + response must fit the target's positions (``max_position_embeddings``; None: unknown, not checked).

    Regeneration would otherwise run the target past its RoPE range, which
    raises deep in the model or, worse, silently generates from garbage positions.
    """
    longest = int(data["prompt_max_tokens"]) + int(data["response_tokens"])
    if max_positions is not None and longest > max_positions:
        raise DFlash2Error(
            f"data.prompt_max_tokens={data['prompt_max_tokens']} + data.response_tokens={data['response_tokens']} "
            f"= {longest} exceeds the target's context of {max_positions} positions; lower one of them"
        )


def resolve_ckpt_path(ckpt_path, output_dir: Path) -> str | None:
    """``ckpt_path`` as a file path (``last`` = the run's ``checkpoints/last.ckpt``), None when not resuming."""
    if not ckpt_path:
        return None
    path = output_dir / "checkpoints" / "last.ckpt" if str(ckpt_path) == "last" else Path(str(ckpt_path))
    if not path.is_file():
        raise DFlash2Error(
            f"ckpt_path={ckpt_path}: no checkpoint file at {path}; "
            "pass a .ckpt file or 'last' with the run's paths.output_dir"
        )
    return str(path)


def check_drafter_files(cfg, output_dir: Path) -> None:
    """The drafter files a drafter run reads (``drafter.init_from``, ``ckpt_path``), checked on their own.

    Called before a target is built or copied into the run, so a damaged, foreign or
    crafted file costs seconds and leaves no ``target/``, ``drafter/`` or ``checkpoints/``.
    Whether they fit the target and the drafter settings is checked later (train_drafter).
    """
    init_from = (cfg.get("drafter") or {}).get("init_from")
    if init_from:
        check_drafter_folder(init_from)
    resume_from = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir)
    if resume_from is not None:
        read_resume_checkpoint(resume_from)


def read_resume_checkpoint(path: str) -> dict:
    """The intact drafter checkpoint at ``path`` (with its ``dflash2`` metadata), else a one-line error.

    Lightning would otherwise fail deep inside ``fit`` with a zip or
    state-dict traceback. Loaded memory-mapped (the tensors are not read) and
    weights-only: a crafted file is refused here, before anything of it runs.
    """
    try:
        ckpt = load_torch_file(path, mmap=True)
    except UnsafeFileError as e:
        raise DFlash2Error(f"ckpt_path refused: {e}") from None
    except Exception as e:
        raise DFlash2Error(
            f"ckpt_path={path} is truncated or not a checkpoint ({type(e).__name__}); pass an intact .ckpt "
            f"(an earlier one in {Path(path).parent}) or drop ckpt_path to start over"
        ) from e
    meta = ckpt.get("dflash2") if isinstance(ckpt, dict) else None
    if not isinstance(meta, dict) or "drafter_config" not in meta or "state_dict" not in ckpt:
        raise DFlash2Error(
            f"ckpt_path={path} is not a dflash2 drafter training checkpoint; "
            "pass a .ckpt written by train.py task=drafter"
        )
    return ckpt


def check_resume_checkpoint(path: str, config: DrafterConfig) -> int:
    """``ckpt_path`` must be an intact drafter checkpoint of this run's architecture; returns its
    global step (where the resumed run's logs continue)."""
    ckpt = read_resume_checkpoint(path)
    differ = drafter_config_differences(dict(ckpt["dflash2"]["drafter_config"]), config.to_dict())
    if differ:
        raise DFlash2Error(
            f"ckpt_path={path} was trained with another drafter config ({', '.join(differ[:4])}); "
            "resume with the run's original target and drafter settings, or start a new run"
        )
    return int(ckpt.get("global_step", 0))


def resume_param_order(path: str) -> str | None:
    """How the checkpoint at ``path`` orders its optimizer groups (param_groups.py); None: the older two groups."""
    return read_resume_checkpoint(path)["dflash2"].get("param_order")


def drafter_config_differences(saved: dict, now: dict) -> list[str]:
    """'field: checkpoint X vs now Y' for every architecture/target field that differs.

    Paths are provenance only (a run folder may move); a field the checkpoint
    does not have comes from an older dflash2 and is not compared.
    """
    provenance = {"target_name_or_path", "num_target_layers"}
    keys = sorted(k for k in now if k in saved and k not in provenance and saved[k] != now[k])
    return [f"{k}: checkpoint {saved[k]!r} vs now {now[k]!r}" for k in keys]
