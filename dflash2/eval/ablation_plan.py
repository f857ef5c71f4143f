"""What the ablation runs (issue 11; docs/ABLATION.md): the variants, the (variant, seed) runs, where each
lives, and the exact ``python train.py`` / ``python -m eval.acceptance`` command lines.

A run is identified by its folder, ``OUT/runs/<variant>/seed<seed>``; its evaluation by a subfolder named
after the evaluation settings, so other settings evaluate again without retraining.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash2.config_dir import source_checkout
from dflash2.errors import DFlash2Error


def repo_root() -> Path:
    """The source checkout whose ``train.py`` and ``eval/`` the runs start (an installed wheel has neither)."""
    root = source_checkout()
    if root is None:
        raise DFlash2Error(
            "the ablation starts `python train.py` and `python -m eval.acceptance` of a source checkout; "
            "run it from a clone of the repository (with the package importable from it)"
        )
    return root


# drafter config option (configs/drafter/<name>.yaml) -> what it is
VARIANTS = {
    "dflash": "DFlash v1",
    "dflash_matched": "v1, MLP widened to DFlash2's parameter count",
    "dflash2_conv_only": "v1 + block-local conv",
    "dflash2_selector_only": "v1 + candidate selector",
    "dflash2": "DFlash2 (conv + selector)",
}
BASELINE = "dflash"
# Set by the ablation for each run; a user override of these would silently break the design.
RESERVED_KEYS = {
    "seed",
    "task",
    "drafter",
    "data.seed",
    "ckpt_path",
    "paths.output_dir",
    "drafter.version",
    "drafter.use_local_conv",
    "drafter.use_selector",
    "drafter.match_dflash2_parameters",
}
RECORD = "ablation_settings.json"  # the training settings an output folder was made with (resume check)
TIMES = "ablation_times.json"  # per run: wall seconds of its training and of each evaluation


@dataclass
class Settings:
    out: Path
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    jobs: int = 1
    threads_per_run: int = 1
    data_seed: int = 0
    num_prompts: int = 32
    max_new_tokens: int = 128
    prompt_tokens: int = 64
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of every `python train.py`

    @property
    def eval_name(self) -> str:
        """Folder of one evaluation setting inside a run: other settings evaluate again, no retraining."""
        return f"eval_p{self.num_prompts}_new{self.max_new_tokens}_len{self.prompt_tokens}"

    @property
    def deterministic(self) -> bool:
        return self.threads_per_run == 1


@dataclass
class Run:
    variant: str
    seed: int
    dir: Path
    eval_dir: Path

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    @property
    def trained(self) -> bool:
        # train_summary.json is written after the drafter folder (train_drafter.py): both there = complete
        drafter = self.dir / "drafter"
        return (
            (drafter / "config.json").is_file()
            and (drafter / "model.safetensors").is_file()
            and (self.dir / "train_summary.json").is_file()
        )

    @property
    def evaluated(self) -> bool:
        return (self.eval_dir / "results.json").is_file()


def override_key(override: str) -> str:
    """`~a.b`, `+a.b=1`, `++a.b=1`, `a.b=1` -> `a.b`."""
    return override.lstrip("~+").split("=", 1)[0]


def check_overrides(overrides: list[str]) -> None:
    for o in overrides:
        key = override_key(o)
        if key in RESERVED_KEYS:
            raise DFlash2Error(
                f"override {o!r} is set by the ablation for each run; choose variants with --variants, seeds with "
                f"--seeds and the data seed with --data-seed"
            )


def plan(settings: Settings) -> list[Run]:
    unknown = [v for v in settings.variants if v not in VARIANTS]
    if unknown:
        raise DFlash2Error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if not settings.seeds:
        raise DFlash2Error("no seeds given; pass --seeds 0 1 2")
    runs = []
    for variant in settings.variants:
        for seed in settings.seeds:
            run_dir = settings.out / "runs" / variant / f"seed{seed}"
            runs.append(Run(variant, seed, run_dir, run_dir / settings.eval_name))
    return runs


def record_or_check(settings: Settings) -> None:
    """An output folder is resumed only with the training settings it was made with."""
    wanted = {
        "overrides": settings.overrides,
        "data_seed": settings.data_seed,
        "threads_per_run": settings.threads_per_run,
    }
    path = settings.out / RECORD
    if path.is_file():
        made = json.loads(path.read_text())
        if made != wanted:
            changed = sorted(k for k in wanted if made.get(k) != wanted[k])
            raise DFlash2Error(
                f"{settings.out} holds runs made with other {', '.join(changed)} ({made}); "
                f"pass the same settings to resume it, or another --out"
            )
        return
    settings.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=2) + "\n")


def prepare_command(settings: Settings) -> list[str]:
    return [
        sys.executable,
        str(repo_root() / "train.py"),
        *settings.overrides,
        "task=data",
        f"seed={settings.data_seed}",
        f"paths.output_dir={settings.out / 'prepare'}",
    ]


def train_command(settings: Settings, run: Run, target_dir: Path) -> list[str]:
    user_keys = {override_key(o) for o in settings.overrides}
    defaults = []  # quiet, light logging for children writing into files; a user override wins
    if "logger" not in user_keys:
        defaults.append("logger=csv")  # light, and its metrics.csv rows feed the progress display
    if "trainer.enable_progress_bar" not in user_keys:
        defaults.append("trainer.enable_progress_bar=false")
    if "callbacks.progress_bar" not in user_keys:
        defaults.append("~callbacks.progress_bar")
    resume = ["ckpt_path=last"] if (run.dir / "checkpoints" / "last.ckpt").is_file() else []
    return [
        sys.executable,
        str(repo_root() / "train.py"),
        *defaults,
        *(o for o in settings.overrides if override_key(o) != "target.path"),
        f"target.path={target_dir}",
        f"drafter={run.variant}",
        f"seed={run.seed}",
        f"data.seed={settings.data_seed}",
        f"paths.output_dir={run.dir}",
        *resume,
    ]


def eval_command(settings: Settings, run: Run, target_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eval.acceptance",
        f"target={target_dir}",
        f"drafter={run.dir / 'drafter'}",
        "prompts=heldout",
        f"num_prompts={settings.num_prompts}",
        f"prompt_tokens={settings.prompt_tokens}",
        f"max_new_tokens={settings.max_new_tokens}",
        "temperature=0.0",
        "device=cpu",
        "seed=0",  # the same prompts and decoding seed for every drafter
        f"paths.output_dir={run.eval_dir}",
    ]
