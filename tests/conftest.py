"""Shared test setup.

Tests run on CPU in fp32 with a fixed small thread count so that results are
repeatable; session-scoped fixtures build the micro models once.
"""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

# One thread: tiny test models gain nothing from more, and oversubscribed OpenMP
# threads (several processes on 2 cores) slow small matmuls down by 10-40x.
torch.set_num_threads(1)


REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child `python` of a test: the repo and tests importable *in front of* the
    caller's PYTHONPATH (kept: the GPU image installs the extra wheels there), offline wandb, 1 thread."""
    path = os.pathsep.join(p for p in (str(REPO), str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        **extra,
    }


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


MICRO_RECIPE = {
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "max_position_embeddings": 1024,
}


# Hydra overrides that build the embedded target recipe (`experiment=target_tiny`) at
# micro size in seconds (test_build_target.py, test_reproducibility.py).
MICRO_TARGET_OVERRIDES = [
    "experiment=target_tiny",
    "target.recipe.vocab_size=320",
    "target.recipe.hidden_size=32",
    "target.recipe.intermediate_size=64",
    "target.recipe.num_attention_heads=2",
    "target.recipe.num_key_value_heads=1",
    "target.recipe.head_dim=16",
    "target.recipe.linear_num_key_heads=2",
    "target.recipe.linear_num_value_heads=2",
    "target.recipe.linear_key_head_dim=8",
    "target.recipe.linear_value_head_dim=8",
    "target.recipe.seq_len=32",
    "target.recipe.batch_size=4",
    "target.recipe.max_steps=3",
    "target.recipe.warmup_steps=1",
    "target.recipe.eval_windows=4",
    "target.recipe.tokenizer_train_bytes=300000",
    "target.recipe.max_train_tokens=20000",
    "trainer.enable_progress_bar=false",
]

# Hydra overrides (besides paths.cache_dir and target.path) that make a drafter run of
# `python train.py` take seconds on a micro target (micro_train_overrides, test_reproducibility.py).
MICRO_DRAFTER_OVERRIDES = [
    "target.target_layer_ids=[0,1,2]",
    "data.num_train_prompts=24",
    "data.num_val_prompts=8",
    "data.response_tokens=24",
    "data.prompt_min_tokens=8",
    "data.prompt_max_tokens=16",
    "data.generation_batch_size=8",
    "data.batch_size=4",
    "drafter.num_hidden_layers=1",
    "drafter.num_attention_heads=2",
    "drafter.num_key_value_heads=1",
    "drafter.num_anchors=6",
    "drafter.selector_rank=16",
    "drafter.selector_top_k=4",
    "drafter.lr=3e-3",
    "heldout_tau.num_prompts=2",
    "heldout_tau.prompt_tokens=16",
    "heldout_tau.max_new_tokens=16",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "~callbacks.progress_bar",
    "callbacks.model_checkpoint.every_n_train_steps=3",
    "logger=csv",
]


@pytest.fixture(scope="session")
def micro_target_dir(tmp_path_factory):
    """A random-weight 3:1 hybrid target with a real BPE tokenizer, saved as an HF folder (seconds)."""
    from transformers import AutoModelForCausalLM

    from dflash2.corpus import load_documents
    from dflash2.target_recipe import hybrid_target_config
    from dflash2.tokenizer import train_bpe_tokenizer

    docs = load_documents([{"kind": "stdlib"}], "train", max_documents=60)
    tokenizer = train_bpe_tokenizer(
        (d.text for d in docs), vocab_size=MICRO_RECIPE["vocab_size"], max_train_bytes=400_000
    )
    config = hybrid_target_config(
        MICRO_RECIPE, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    out = tmp_path_factory.mktemp("micro_target")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def micro_train_overrides(micro_target_dir, tmp_path_factory):
    """Hydra overrides that make `python train.py` run in seconds on the micro target.

    One cache folder for the session: regenerated data is keyed by a fingerprint
    of target + corpus + settings, so runs with the same data share it.
    """
    cache = tmp_path_factory.mktemp("dflash2_cache")
    return [f"paths.cache_dir={cache}", f"target.path={micro_target_dir}", *MICRO_DRAFTER_OVERRIDES]


# ---------------------------------------------------------------- reference decoding (issue 4)
# Tiny random fp32 targets + drafters shared by test_reference_*.py, test_gdn_rollback.py and
# test_eval_acceptance.py. initializer_range 0.1 (not HF's 0.02): greedy outputs of random
# models stay diverse for 200+ tokens and top-2 logit margins stay >= 1e-3, far above fp32
# rounding, so "spec == greedy token for token" tests the algorithm, not near-ties.
SPEC_VOCAB = 128


def spec_target_config(kind: str, vocab_size: int = SPEC_VOCAB, hidden_size: int = 32):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.1,
        max_position_embeddings=1024,
    )
    if kind == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=2, **common)
    # Qwen3.5 text: 3 Gated DeltaNet : 1 attention, as the real hybrids (ARCHITECTURE.md §5)
    return transformers.Qwen3_5TextConfig(
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        **common,
    )


def spec_target(kind: str, seed: int = 0, **kw):
    """A frozen TargetModel around a random tiny HF model, taps at layers [0, 1]."""
    from transformers import AutoModelForCausalLM

    from dflash2.target import TargetModel

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec_target_config(kind, **kw)).float()
    return TargetModel(model, target_layer_ids=[0, 1])


def spec_drafter(target, block_size: int, v2: bool = False, seed: int = 1):
    """A random DFlash (v1) or DFlash2 (conv + selector) drafter matching ``target``.

    The DFlash2 one has its conv and selector moved off their init (``randomize_dflash2_additions``):
    at init they are exact no-ops and would draft what v1 drafts, testing nothing of their own."""
    from dflash2.drafter import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size,
        target_layer_ids=list(target.target_layer_ids),
        mask_token_id=target.vocab_size - 1,
        block_size=block_size,
        use_local_conv=v2,
        conv_group_size=8,
        use_selector=v2,
        selector_rank=8,
        selector_top_k=4,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).eval()
    if v2:
        randomize_dflash2_additions(drafter, seed)
    return drafter


def randomize_dflash2_additions(drafter, seed: int) -> None:
    """Non-trivial DFlash2 additions, in place: a fresh conv is the identity (base kernel tap 0 = 1, no
    dynamic part) and a fresh selector's pair term is ~0 (plain argmax). Here the base kernel is
    perturbed, the kernel projection and the codebooks are random. Scales: with the spec targets'
    logits (std ~0.6) the pair term then changes 30-75% of the greedy drafts (measured over both
    targets, B 4-16, a few seeds), so the unary logits still matter too."""
    g = torch.Generator().manual_seed(1000 + seed)

    def normal(param, std):
        param.copy_(std * torch.randn(param.shape, generator=g))

    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.5 * torch.randn(conv.base_kernel.shape, generator=g))
                normal(conv.kernel_projection.weight, 0.5)
        selector = drafter.candidate_selector
        normal(selector.predecessor_codebook, 0.6)
        normal(selector.successor_codebook, 0.6)
        normal(selector.hidden_projection.weight, 0.2)


@pytest.fixture(scope="session")
def spec_targets():
    """{'qwen3': attention target, 'qwen3_5': hybrid GDN target}, random weights, built once."""
    return {kind: spec_target(kind) for kind in ("qwen3", "qwen3_5")}


@pytest.fixture(scope="session")
def make_spec_target():
    return spec_target


@pytest.fixture(scope="session")
def make_spec_drafter():
    return spec_drafter


# ---------------------------------------------------------------- statistics
def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of integer samples to probs (V,); bins with expected < min_expected are
    pooled. The survival function of the chi-square law is the regularised upper incomplete gamma
    Q(df/2, stat/2), so scipy is not needed. Used by the statistical tests of T>0 decoding and sampling."""
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    expected = probs.double() * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:  # no pooled bin: anything observed there was impossible under probs
        if obs[-1] > 0:
            return 0.0
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
