"""The drafter's optimizer parameter groups: weight decay on matrices, the parameters in the module's order.

Why the module's order, in runs of consecutive parameters with the same decay, rather than the two
groups "matrices" and "the rest": an optimizer state saved from one device or DDP names each
parameter by its position in the optimizer's groups, and Lightning's FSDP strategy maps those
positions to parameter names by the *module's* order when it resumes such a checkpoint (measured on
the GPU: a two-group checkpoint resumed under FSDP put a matrix's moments on a norm weight and the
fused AdamW refused them; with equal shapes, e.g. the q and k norms, the swap would be silent). With
the optimizer in module order the two numberings agree. The other way, FSDP → one device or DDP,
maps by the group lists and was already right.

Checkpoints written before this order (``param_order`` missing from their ``dflash2`` entry) hold the
two-group layout; :func:`regroup_two_group_checkpoint` rewrites their optimizer and scheduler state
into this one, which serves resuming them on one device or DDP. Under FSDP Lightning loads the
optimizer before any hook of ours runs, so such a checkpoint is refused there (:func:`check_param_order`).
"""

from __future__ import annotations

from itertools import groupby

from dflash2.errors import DFlash2Error

PARAM_ORDER = "module"  # the marker this layout writes into checkpoint["dflash2"]["param_order"]


def decay_runs(names: list[str], decayed: set[str]) -> list[tuple[bool, list[str]]]:
    """``names`` (the trainable parameters in module order) cut into maximal runs of equal decay.

    Returns [(decays, [name, ...]), ...]; concatenated, the runs are ``names`` again.
    """
    return [(decays, list(run)) for decays, run in groupby(names, key=lambda n: n in decayed)]


def regroup_two_group_checkpoint(checkpoint: dict, names: list[str], decayed: set[str]) -> None:
    """Rewrite, in place, a checkpoint's optimizer and LR-scheduler state from the two-group layout
    (group 0: the decayed parameters, group 1: the others, each in module order) into :func:`decay_runs`.

    The moments move with their parameter (old position → new position by name); each new group
    takes the hyperparameters (lr, weight decay, betas, ...) of the old group its parameters were in,
    and the scheduler's per-group lists (base and last lr) likewise.
    """
    runs = decay_runs(names, decayed)
    old_order = [n for n in names if n in decayed] + [n for n in names if n not in decayed]
    new_position = {name: i for i, name in enumerate(names)}
    two_groups = [sum(n in decayed for n in names), sum(n not in decayed for n in names)]
    for opt in checkpoint.get("optimizer_states", []):
        groups = opt["param_groups"]
        if [len(g["params"]) for g in groups] != two_groups:
            raise DFlash2Error(
                "the checkpoint's optimizer state has neither this drafter's parameter order nor its older "
                f"two-group layout ({[len(g['params']) for g in groups]} parameters per group, expected "
                f"{two_groups}); resume with the same drafter config"
            )
        old_ids = [i for g in groups for i in g["params"]]
        moved = {old_ids[k]: new_position[name] for k, name in enumerate(old_order)}
        opt["state"] = {moved[i]: state for i, state in opt["state"].items()}
        opt["param_groups"] = [
            {**groups[0 if decays else 1], "params": [new_position[n] for n in run]} for decays, run in runs
        ]
    for sched in checkpoint.get("lr_schedulers", []):
        for key in ("base_lrs", "_last_lr", "lr_lambdas"):
            values = sched.get(key)
            if isinstance(values, list) and len(values) == 2:
                sched[key] = [values[0 if decays else 1] for decays, _ in runs]


def check_param_order(param_order: str | None, *, fsdp: bool) -> None:
    """Refuse to resume a two-group checkpoint (``param_order`` None) under FSDP (see the module docstring)."""
    if fsdp and param_order != PARAM_ORDER:
        raise DFlash2Error(
            "this checkpoint was written before dflash2 kept the optimizer in the module's parameter order, "
            "and Lightning's FSDP would pair its optimizer moments with the wrong parameters; resume it on one "
            "device or with trainer=ddp (its checkpoints then resume under FSDP too)"
        )
