"""Shared test setup.

Tests run on CPU in fp32 with a fixed small thread count so that results are
repeatable; session-scoped fixtures build the micro models once.
"""

import os
import random
import sys

# flash-linear-attention, where installed (the GPU machine's wheels), is hidden from the tests: none uses
# it, and with it importable transformers sends the CPU tensors of HF's Qwen3.5 reference forwards (the
# fixtures' greedy references) to fla's Triton kernels, which refuse them. Hidden, HF takes its own
# PyTorch path, the one CI runs. A None entry makes both `import fla` and importlib's find_spec say "absent".
if "fla" not in sys.modules:
    sys.modules["fla"] = None

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, the runtime's Triton kernels are tested through Triton's interpreter, which has to be
# chosen before triton is first imported (triton 3.9 jits triton.language's own helpers then:
# dflash2/runtime/kernels/triton_util.py). CPU tensors reach the fused kernels only inside
# dflash2.runtime.kernels.on_cpu() (test_runtime_kernels.py) and the GDN kernels through
# GDNState(mode="replay" | "native") (test_runtime_gdn_*.py). With a GPU the kernels run for real
# and their CPU cases skip (or run the suite with TRITON_INTERPRET=1 to interpret everything).
if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter runs a reduction with our own combine (the GDN recurrence's fma sums) element by
    # element; slice by slice gives the same values about three times faster (interpreter_reduce.py)
    from dflash2.runtime.kernels.interpreter_nested_calls import skip_repatching_nested_calls
    from dflash2.runtime.kernels.interpreter_reduce import vectorize_interpreter_reductions

    vectorize_interpreter_reductions()
    # and a jit helper's call re-patches triton.language that its launch already patched (5-8% of the
    # engine-level GDN tests' time): interpreter_nested_calls.py skips that
    skip_repatching_nested_calls()

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


def write_near_copy_families(root: Path, families: int = 30, copies: int = 4) -> list[list[str]]:
    """Families of near-copies (one line in ten rewritten) under unrelated names, plus 100 unrelated
    files, in a `dir` corpus named "fam" (tests of the near-duplicate split); returns each family's keys."""
    rng = random.Random(0)

    def word() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))

    keys = []
    for _ in range(families):
        base = [f"def {word()}(x):\n    return x * {rng.randint(2, 10**6)} + {word()}" for _ in range(30)]
        family = []
        for _ in range(copies):
            lines = [word() + " = 0" if rng.random() < 0.1 else line for line in base]
            name = f"{word()}/{word()}.py"  # the name tells nothing about the family
            _write_text(root / name, "\n".join(lines) + "\n")
            family.append(f"dir:fam:{name}")
        keys.append(family)
    for i in range(100):  # unrelated documents
        _write_text(root / f"solo/{word()}.py", "\n".join(f"{word()} = '{word()}{i}'" for _ in range(20)) + "\n")
    return keys


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


class _RunsOnLoad:
    """Unpickling this calls ``func(*args)``: what a crafted ``.ckpt`` can make ``torch.load`` do."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def crafted_checkpoint(path: Path, marker: Path, base: dict, how: str = "touch", legacy: bool = False) -> Path:
    """Save ``base`` (a real checkpoint dict) to ``path`` plus one entry whose unpickling creates ``marker``.

    how: "touch" (``pathlib.Path.touch(marker)``) or "shell" (``os.system("touch marker")``); legacy: torch's
    pre-1.6 non-zip format. A load with ``weights_only=False`` creates the marker and returns an otherwise
    valid checkpoint.
    """
    import shlex

    if how == "touch":
        payload = _RunsOnLoad(Path.touch, (Path(marker),))
    else:
        payload = _RunsOnLoad(os.system, (f"touch {shlex.quote(str(marker))}",))
    torch.save({**base, "notes": payload}, path, _use_new_zipfile_serialization=not legacy)
    assert not Path(marker).exists()
    return Path(path)


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
    # the τ decoded at each validation, at the size of the held-out one: its default (4 prompts × 64
    # tokens) took 4 s of a 13 s micro run
    "callbacks.measured_tau.num_prompts=2",
    "callbacks.measured_tau.max_new_tokens=16",
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
    """A random DFlash (v1) or DFlash2 (conv + selector) drafter matching ``target``. The DFlash2
    additions are at their init (no-ops): pass it through ``nontrivial_dflash2`` to test them."""
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
    return DFlashDrafter(cfg).eval()


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


# ---------------------------------------------------------------- runtime (issue 13)
# The runtime's own forwards are checked against HF for three families: attention-only Qwen3,
# Llama (biases, tied embeddings, Llama-3 RoPE scaling) and the Qwen3.5 hybrid (3 GDN : 1 attention).
RUNTIME_KINDS = ("qwen3", "llama", "qwen3_5")


def runtime_hf_config(kind: str, vocab_size: int = SPEC_VOCAB):
    import transformers

    if kind != "llama":
        return spec_target_config(kind, vocab_size)  # qwen3_5: partial RoPE (1/4 of each head)
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.1,
        max_position_embeddings=1024,
        attention_bias=True,  # biases are randomised below, so they are really checked
        tie_word_embeddings=True,  # the checkpoint has no lm_head.weight: the loader ties
        # Llama-3 frequency scaling, with an original context short enough to change some frequencies
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )


def build_runtime_hf(kind: str, seed: int = 0, vocab_size: int = SPEC_VOCAB, **config):
    """A random fp32 HF model of ``kind`` (biases randomised too: zero biases would check nothing);
    config: fields of ``runtime_hf_config(kind)`` to change (e.g. ``linear_num_value_heads=2``)."""
    from transformers import AutoModelForCausalLM

    hf_config = runtime_hf_config(kind, vocab_size)
    for name, value in config.items():
        assert hasattr(hf_config, name), name
        setattr(hf_config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="session")
def hf_targets(tmp_path_factory):
    """{kind: (HF model fp32, folder with its fp32 safetensors)} for every runtime family, built once."""
    out = {}
    for kind in RUNTIME_KINDS:
        model = build_runtime_hf(kind)
        folder = tmp_path_factory.mktemp(f"rt_{kind}")
        model.save_pretrained(folder)
        out[kind] = (model, folder)
    return out


def nontrivial_dflash2(drafter, seed: int = 7):
    """Move a DFlash2 drafter's conv off the identity and its selector off ~argmax (in place).

    At init both are no-ops (identity conv, near-zero pair term): a fresh DFlash2 drafter drafts what
    v1 drafts, and a test through it would check nothing of its own. Scales: with the spec targets'
    logits (std ~0.6) the pair term changes 30-75% of the greedy drafts (measured over both targets,
    B 4-16, a few seeds), so the unary logits still matter too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.5 * torch.randn(conv.base_kernel.shape, generator=g))
                conv.kernel_projection.weight.copy_(0.5 * torch.randn(conv.kernel_projection.weight.shape, generator=g))
        sel = drafter.candidate_selector
        for p, std in (
            (sel.predecessor_codebook, 0.6),
            (sel.successor_codebook, 0.6),
            (sel.hidden_projection.weight, 0.2),
        ):
            p.copy_(std * torch.randn(p.shape, generator=g))
    return drafter


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


@pytest.fixture
def interpret():
    """While a test runs, CPU tensors reach the runtime's Triton kernels through the interpreter
    (``kernels.on_cpu()``) when TRITON_INTERPRET=1; on a GPU machine nothing changes: the kernels' GPU
    cases run for real and their CPU cases are left out (tests/kernel_devices.py)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from dflash2.runtime import kernels

    with kernels.on_cpu():
        yield


def training_step(target, drafter, device, **switches):
    """One block_outputs + backward of the training module built around a copy of ``drafter`` (settings of a
    small DFlash2 run plus ``switches``, e.g. ``conv_kernels=True``), on a fixed batch of 2 rows × 24 tokens.
    Returns (module, outputs, {parameter name: gradient}): what the kernel switches' tests compare on and off."""
    import copy

    from dflash2.drafter.objective import anchor_generator
    from dflash2.training.train_drafter import training_module

    settings = dict(num_anchors=5, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.0)
    settings.update(warmup_ratio=0.0, selector_gold_injection=True, **switches)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": (torch.arange(24) >= 8).long().expand(2, 24)}
    module = training_module(
        copy.deepcopy(drafter), target, settings, total_steps=1, seed=0, target_id="t", loss_chunk=7, attention="dense"
    )
    module.to(device)
    module._sync_target_device()
    out = module.block_outputs({k: v.to(device) for k, v in batch.items()}, anchor_generator(0, 0))
    out["loss"].backward()
    return module, out, {n: p.grad for n, p in module.drafter.named_parameters() if p.grad is not None}
