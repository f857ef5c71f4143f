"""Build (or reuse) the embedded default target (ARCHITECTURE.md §8, issue 2).

`ensure_target(cfg)` returns the folder of an HF causal LM for the run:
- `target.path` set: that folder or hub id, used as is;
- otherwise the embedded recipe: tokenizer + hybrid GDN model pretrained on the
  corpus train split, cached under `paths.cache_dir/targets/<name>-<key>/`
  where the key hashes the recipe, corpus and seed, so a later run with the
  same settings reuses it and a changed setting rebuilds it.
The build is written to a temporary folder and renamed into place, so the cache
never holds a half-built target.

Crash safety (issue 6): while it runs, a build keeps a work folder
`paths.cache_dir/targets/.<name>-<key>.build/` with the trained tokenizer and a
Lightning checkpoint `last.ckpt` every `recipe.checkpoint_every_steps` steps
(written atomically by `AtomicCheckpointIO`). A build killed mid-way (SIGKILL,
power loss) resumes from that checkpoint the next time the same target is asked
for, with the same data order, and gives bitwise the same weights as a build
that never stopped; the work folder is removed once the target is in place.
Bitwise because all state that matters is in the checkpoint (weights, AdamW
moments and step counts, the LR schedule's step, the loop's global_step) and the
training step draws no random numbers (the model has no dropout; windows come
from per-index generators), so the global RNG state, which Lightning does not
save, plays no part. `build_seconds` in build_info.json counts the last attempt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from dflash2.corpus import corpus_fingerprint, load_documents, split_kwargs
from dflash2.errors import DFlash2Error
from dflash2.oom import explain_oom, knob_hints
from dflash2.safe_load import load_torch_file
from dflash2.target_recipe import hybrid_target_config
from dflash2.tokenizer import EOS_TOKEN, PAD_TOKEN, encode_documents, train_bpe_tokenizer, wrap_tokenizer
from dflash2.training.atomic_checkpoint_io import AtomicCheckpointIO
from dflash2.training.fla_backward_check import fla_backward_refusal
from dflash2.training.launch import PREPARE_FIRST, external_world_size
from dflash2.training.target_chat_mix import RECIPE_KEY as CHAT_KEY
from dflash2.training.target_chat_mix import chat_fraction, chat_mix_cache_entry, chat_pretraining_tokens
from dflash2.training.target_pretrain import (
    CausalLMPretrainModule,
    RandomWindows,
    ResumableWindowsData,
    consecutive_windows,
    heldout_cross_entropy,
    perplexity,
    unigram_cross_entropies,
)

log = logging.getLogger(__name__)
RECIPE_VERSION = 1  # bump when the build procedure changes in a way that changes results
BUILD_INFO = "build_info.json"
# Recipe keys that change how a build runs but not what it produces: left out of the cache key.
NON_RESULT_RECIPE_KEYS = ("checkpoint_every_steps",)
LAST_CKPT = "last.ckpt"
WORK_TOKENIZER = "tokenizer.json"


def to_plain(node: Any) -> Any:
    """An OmegaConf node as plain Python containers (other values unchanged)."""
    return (
        OmegaConf.to_container(node, resolve=True)
        if isinstance(node, DictConfig) or OmegaConf.is_config(node)
        else node
    )


def target_build_seed(cfg: DictConfig) -> int:
    """The seed the embedded target is built from: `target.seed`, not the run's `seed`, so that a sweep
    over drafter seeds (`-m seed=0,1,2`) shares one cached target instead of pretraining one per seed.
    A target config without the field falls back to the run's seed (the behaviour before it existed)."""
    seed = cfg.target.get("seed")
    return int(cfg.seed if seed is None else seed)


def target_cache_key(cfg: DictConfig) -> str:
    """Hash of everything the built target depends on."""
    sources = list(to_plain(cfg.data.sources)) + list(to_plain(cfg.target.recipe.get("extra_sources", [])) or [])
    recipe = {k: v for k, v in to_plain(cfg.target.recipe).items() if k not in NON_RESULT_RECIPE_KEYS}
    chat = chat_mix_cache_entry(recipe)
    recipe.pop(CHAT_KEY, None)  # in the key through `chat` only, so chat_fraction: 0 keeps a code-only target's key
    payload = {
        "recipe": recipe,
        "corpus": corpus_fingerprint(sources, "train", **_split_kwargs(cfg)),
        "seed": target_build_seed(cfg),
        "version": RECIPE_VERSION,
    }
    if chat is not None:
        payload["chat"] = chat
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _split_kwargs(cfg: DictConfig) -> dict:
    return split_kwargs(to_plain(cfg.data))


def ensure_target(cfg: DictConfig) -> Path | str:
    """The target to use for this run: an existing path/hub id, or the cached embedded build."""
    if cfg.target.get("path"):
        return cfg.target.path
    if cfg.target.get("recipe") is None:
        raise DFlash2Error("target.path is not set and the target config has no recipe; pass target.path=DIR_OR_HUB_ID")
    cache_root = Path(cfg.paths.cache_dir) / "targets"
    final = cache_root / f"{cfg.target.name}-{target_cache_key(cfg)}"
    if (final / BUILD_INFO).exists():
        log.info("reusing cached target %s", final)
        shutil.rmtree(build_work_dir(final), ignore_errors=True)  # left if a build died right after publishing
        return final
    if external_world_size() > 1:
        raise DFlash2Error(f"the target is not built yet ({final}); {PREPARE_FIRST}")
    with _build_lock(final):  # builds of one target share a work folder: one at a time
        if not (final / BUILD_INFO).exists():  # else built by the process we waited for
            build_embedded_target(cfg, final)
    return final


@contextmanager
def _build_lock(final: Path):
    """Hold an exclusive lock on `.<final name>.lock` next to `final` (POSIX `flock`).

    A second process asking for the same target waits here, then finds it built. The
    kernel drops the lock when its holder dies, even by SIGKILL. Without `fcntl`
    (Windows) there is no lock.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(f"waiting for another process that is building {final}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # unlocked when the file is closed


def publish_target(source: Path | str, output_dir: Path) -> Path | str:
    """Copy a built target into `output_dir/target/` (atomically); external targets are referenced."""
    dest = output_dir / "target"
    if not Path(str(source)).is_dir():
        return source  # a hub id: nothing to copy
    if dest.exists():
        return dest
    if _folder_bytes(Path(source)) > 2 * 1024**3:
        dest.symlink_to(Path(source).resolve(), target_is_directory=True)  # do not duplicate a large model
        return dest
    tmp = output_dir / f".target.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    try:
        os.replace(tmp, dest)
    except OSError:
        # Another rank of a torchrun / SLURM launch (all start at once) published the same copy first.
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.is_dir():
            raise
    return dest


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def build_work_dir(final: Path) -> Path:
    """Where the build of `final` keeps its tokenizer and checkpoints until it is published."""
    return final.parent / f".{final.name}.build"


def _checkpoint_step(path: Path) -> int | None:
    """`global_step` of a Lightning checkpoint, or None if it is missing or unreadable."""
    try:
        return int(load_torch_file(path, mmap=True)["global_step"])
    except FileNotFoundError:
        return None
    except Exception as err:  # written atomically, so this needs a damaged disk or a foreign file
        log.warning(f"ignoring unreadable target-build checkpoint {path} ({type(err).__name__}: {err}); starting over")
        return None


def _work_tokenizer(work: Path, train):
    """The build's tokenizer: the one saved in `work` by an earlier (killed) attempt, else `train()` saved there.

    Saved as the backend `tokenizer.json` and wrapped again with `wrap_tokenizer`, so the
    reloaded tokenizer is the trained one (the training is deterministic, too).
    """
    from tokenizers import Tokenizer

    saved = work / WORK_TOKENIZER
    if saved.exists():
        return wrap_tokenizer(Tokenizer.from_str(saved.read_text(encoding="utf-8")))
    tokenizer = train()
    tmp = work / f".{WORK_TOKENIZER}.tmp-{os.getpid()}"
    tmp.write_text(tokenizer.backend_tokenizer.to_str(), encoding="utf-8")
    os.replace(tmp, saved)
    return tokenizer


def build_embedded_target(cfg: DictConfig, final: Path) -> dict:
    """Train tokenizer + hybrid target from the recipe and save it to `final`.

    Resumes from `build_work_dir(final)/last.ckpt` when an earlier attempt left one.
    """
    refusal = fla_backward_refusal(cfg.trainer.get("accelerator", "cpu"))
    if refusal is not None:
        raise DFlash2Error(refusal)
    recipe = cfg.target.recipe
    seed = target_build_seed(cfg)
    started = time.time()
    L.seed_everything(seed, workers=True, verbose=False)
    sources = list(to_plain(cfg.data.sources)) + list(to_plain(recipe.get("extra_sources", [])) or [])
    log.info(f"building target '{cfg.target.name}' (not in cache) -> {final}")
    work = build_work_dir(final)
    work.mkdir(parents=True, exist_ok=True)
    resume_from = work / LAST_CKPT
    resume_step = _checkpoint_step(resume_from)
    if resume_step is None:
        resume_from.unlink(missing_ok=True)
    else:
        log.info(f"resuming target build from step {resume_step} ({resume_from})")

    train_docs = load_documents(sources, "train", **_split_kwargs(cfg))
    heldout_docs = load_documents(sources, "heldout", **_split_kwargs(cfg))
    if not train_docs or not heldout_docs:
        raise DFlash2Error(
            f"corpus {sources} gave {len(train_docs)} train and {len(heldout_docs)} held-out documents; "
            "add more sources"
        )
    log.info(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out documents")

    tokenizer = _work_tokenizer(
        work,
        lambda: train_bpe_tokenizer(
            (d.text for d in train_docs),
            vocab_size=int(recipe.vocab_size),
            max_train_bytes=int(recipe.tokenizer_train_bytes),
        ),
    )
    train_tokens = encode_documents(tokenizer, _take_tokens(train_docs, tokenizer, int(recipe.max_train_tokens), seed))
    heldout_tokens = encode_documents(tokenizer, heldout_docs, show_progress=False)
    log.info(f"tokens: {len(train_tokens):,} train / {len(heldout_tokens):,} held-out")
    code_tokens, chat_info = train_tokens, None
    fraction = chat_fraction(recipe)
    if fraction > 0:
        # From train_docs only: the documents the code stream comes from, never validation/held-out ones.
        chat_docs = train_docs
        if recipe.get("extra_sources"):
            # data=chat splits data.sources alone; with extra sources a near-copy cluster can pull one of
            # its held-out documents into the build's train split, so keep documents train in both splits.
            chat_train = {d.key for d in load_documents(to_plain(cfg.data.sources), "train", **_split_kwargs(cfg))}
            chat_docs = [d for d in train_docs if d.key in chat_train]
        chat = chat_pretraining_tokens(chat_docs, tokenizer, len(code_tokens), fraction, seed)
        train_tokens = np.concatenate([code_tokens, chat.tokens])  # windows are drawn at random over both
        chat_info = {
            "fraction_asked": fraction,
            "fraction": round(len(chat.tokens) / len(train_tokens), 4),
            "conversations": len(chat.keys),
            "tokens": len(chat.tokens),
        }
        log.info(
            f"chat pretraining: {len(chat.keys):,} templated conversations from train documents, "
            f"{len(chat.tokens):,} tokens ({chat_info['fraction']:.1%} of the stream)"
        )

    from transformers import AutoModelForCausalLM

    config = hybrid_target_config(
        recipe,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.float()
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"target: {n_params / 1e6:.2f} M params, layers {config.layer_types}")

    steps = int(recipe.max_steps)
    dataset = RandomWindows(train_tokens, int(recipe.seq_len), steps * int(recipe.batch_size), seed)
    data = ResumableWindowsData(
        dataset, int(recipe.batch_size), steps
    )  # batch s = windows [s*B, (s+1)*B), also on resume
    module = CausalLMPretrainModule(
        model, float(recipe.lr), float(recipe.weight_decay), int(recipe.warmup_steps), steps
    )
    every = int(recipe.get("checkpoint_every_steps") or 0)
    callbacks = []
    if every > 0:
        from lightning.pytorch.callbacks import ModelCheckpoint

        # Only last.ckpt (save_top_k=0), replaced atomically every `every` steps; a fixed name, no -v1 versions.
        callbacks.append(
            ModelCheckpoint(
                dirpath=work, save_top_k=0, save_last=True, every_n_train_steps=every, enable_version_counter=False
            )
        )
    trainer = L.Trainer(
        accelerator=cfg.trainer.get("accelerator", "cpu"),
        devices=1,
        precision=cfg.trainer.get("precision", "32-true"),
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=every > 0,
        plugins=[AtomicCheckpointIO()],
        enable_model_summary=False,
        log_every_n_steps=10,
        default_root_dir=str(work),
    )
    oom_hints = knob_hints(cfg, ("target.recipe.batch_size", "target.recipe.seq_len", "target.recipe.hidden_size"))
    with (
        warnings.catch_warnings(),
        explain_oom("target pretraining", oom_hints, extra=", then rerun to resume from the last build checkpoint"),
    ):
        # Lightning warns that a plain DataLoader can't resume mid-epoch; ours restarts at the restored step.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
        trainer.fit(module, datamodule=data, ckpt_path=str(resume_from) if resume_step is not None else None)

    model = module.model.float().cpu().eval()
    windows = consecutive_windows(heldout_tokens, int(recipe.seq_len), int(recipe.eval_windows))
    device = "cuda" if torch.cuda.is_available() and cfg.trainer.get("accelerator") in ("gpu", "cuda") else "cpu"
    ce = heldout_cross_entropy(model.to(device), windows)
    model.cpu()
    # Fitted on the code stream: the held-out text scored is code, so chat text would only blur the baseline.
    baselines = unigram_cross_entropies(code_tokens, windows, config.vocab_size)
    info = {
        "name": cfg.target.name,
        "params": n_params,
        "layer_types": list(config.layer_types),
        "train_tokens_seen": steps * int(recipe.batch_size) * int(recipe.seq_len),
        "heldout_tokens_scored": int(windows[:, 1:].numel()),
        "heldout_cross_entropy": ce,
        "heldout_perplexity": perplexity(ce),
        **{f"heldout_{k}_cross_entropy": v for k, v in baselines.items()},
        "seed": seed,
        "recipe": to_plain(recipe),
        **({"chat_pretraining": chat_info} if chat_info else {}),
        "build_seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
    }
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2))
    if final.exists():  # a concurrent build finished first: keep theirs
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, final)
    shutil.rmtree(work, ignore_errors=True)  # the target is in place: its checkpoints are no longer needed
    log.info(format_target_report(info))
    return info


def _take_tokens(docs, tokenizer, max_tokens: int, seed: int):
    """A seeded shuffle of the documents, cut once about `max_tokens` tokens (≈3.3 bytes/token) are covered.

    Shuffled so that a budget smaller than the corpus still spans all modules
    rather than the alphabetically first ones.
    """
    budget_bytes = int(max_tokens * 3.5)
    taken, used = [], 0
    for i in np.random.default_rng(seed).permutation(len(docs)):
        d = docs[int(i)]
        taken.append(d)
        used += len(d.text.encode("utf-8", errors="replace"))
        if used >= budget_bytes:
            break
    return taken


def format_target_report(info: dict) -> str:
    return (
        f"target '{info['name']}': held-out CE {info['heldout_cross_entropy']:.3f} nats/token "
        f"(ppl {info['heldout_perplexity']:.1f}) vs unigram {info['heldout_unigram_train_cross_entropy']:.3f} "
        f"(train-fitted) / {info['heldout_unigram_oracle_cross_entropy']:.3f} (fitted on the held-out text itself); "
        f"{info['params'] / 1e6:.2f} M params, built in {info['build_seconds']} s"
    )
