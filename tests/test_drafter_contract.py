"""The published DFlash2 checkpoint contract (issue 12 item 4, ARCHITECTURE.md §3.4, §7).

A folder shaped like z-lab's DFlash2 config fixture (sliding-window layers, block 16, conv
kernel 2 / group 16, selector rank 256 / top-k 16, output multiplier, softcap 20, bf16),
sized for the micro target: it loads, drafts exactly what an independent re-implementation
of vLLM's qwen3_dflash2 step drafts, decodes losslessly, exports back bit-identically, and
every way engines would read it differently is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from vllm_reference import VllmStyleDFlash2
from zlab_fixture import ZLAB_OUTPUT_MULTIPLIER, ZLAB_SOFTCAP, write_zlab_dflash2_folder

from dflash2.decoding.decoder import DFlashProposer, greedy_generate, speculative_generate
from dflash2.decoding.sampling import SamplingParams
from dflash2.drafter import load_drafter
from dflash2.drafter.folder_check import check_drafter_folder
from dflash2.errors import DFlash2Error
from dflash2.export import export_drafter
from dflash2.target import TargetModel

TAPS = [0, 1, 2]
WINDOW = 24  # > block 16 like z-lab's 2048, and < the contexts below, so the window bites
PROMPTS = [[5, 17, 42, 99, 7, 61, 3, 250, 88, 12], [200, 3, 3, 64, 9, 31], [11, 250, 31, 8, 120, 77, 45, 19]]


@pytest.fixture(scope="module")
def target(micro_target_dir):
    return TargetModel.from_pretrained(str(micro_target_dir), target_layer_ids=TAPS, dtype="float32")


@pytest.fixture(scope="module")
def zlab_dir(micro_target_dir, tmp_path_factory):
    return write_zlab_dflash2_folder(
        tmp_path_factory.mktemp("zlab") / "drafter",
        micro_target_dir,
        target_layer_ids=TAPS,
        mask_token_id=2,  # the micro tokenizer's <|mask|>
        sliding_window=WINDOW,
    )


def test_the_fixture_loads_with_every_contract_field(zlab_dir):
    cfg = load_drafter(zlab_dir).config
    assert cfg.block_size == 16 and cfg.layer_kinds == ["sliding_attention"] * 5 and cfg.sliding_window == WINDOW
    assert cfg.use_local_conv and cfg.conv_kernel_size == 2 and cfg.conv_group_size == 16
    assert cfg.use_selector and cfg.selector_rank == 256 and cfg.selector_top_k == 16
    assert cfg.final_logit_softcapping == ZLAB_SOFTCAP and cfg.output_multiplier == ZLAB_OUTPUT_MULTIPLIER
    assert cfg.input_embedding_scale == 1.0 and cfg.target_layer_ids == TAPS and cfg.num_target_layers == 4
    assert load_drafter(zlab_dir).fc.weight.dtype == torch.bfloat16  # the stored dtype by default


@torch.no_grad()
def test_drafts_equal_a_vllm_style_reimplementation(zlab_dir, target):
    """Every block of every prompt + continuation: same drafts as the independent vLLM-style step."""
    drafter = load_drafter(zlab_dir, dtype=torch.float32)
    ref = VllmStyleDFlash2(
        zlab_dir, target.embed_tokens.weight, target.lm_head.weight, num_speculative_tokens=15
    )  # = block_size - 1, as the model card says
    plain = VllmStyleDFlash2(zlab_dir, target.embed_tokens.weight, target.lm_head.weight, num_speculative_tokens=15)
    plain.mult, plain.cap = 1.0, None  # the same step without the serving scales
    blocks = changed = unscaled_differs = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt + greedy_generate(target, [prompt], 30)[0]])  # (1, L)
        taps = target.tap_features(ids)  # (1, L, K·d)
        for a in range(1, ids.shape[1], 3):
            proposer = DFlashProposer(drafter, target)
            proposer.add_context(taps[:, :a], torch.arange(a)[None], None)
            ours, _ = proposer.propose(ids[:, a], torch.tensor([a]), SamplingParams(), None)
            theirs, hidden = ref.draft(taps[0, :a], int(ids[0, a]), a)
            assert ours[0].tolist() == theirs, (prompt, a)
            ours_hidden = drafter.draft_block(
                drafter.embed_block(torch.tensor([[int(ids[0, a])] + [2] * 15]), target.embed_tokens),
                a + torch.arange(16)[None],
                proposer.cache,
            )
            # fp32 rounding only (different op order), relative to the final norm's large gain
            torch.testing.assert_close(ours_hidden[0], hidden, atol=2e-6 * float(hidden.abs().max()), rtol=1e-5)
            argmax = target.lm_head(hidden[1:]).argmax(-1).tolist()
            blocks += 1
            changed += sum(x != y for x, y in zip(argmax, theirs))
            unscaled_differs += plain.walk(hidden, int(ids[0, a])) != theirs
    # every part is exercised: the pair term changes picks, and so do the multiplier and the cap
    assert blocks >= 30 and 0.1 < changed / (15 * blocks) < 0.9 and unscaled_differs >= blocks // 3


def test_speculative_decoding_with_the_fixture_is_lossless(zlab_dir, target):
    drafter = load_drafter(zlab_dir, dtype=torch.float32)
    res = speculative_generate(target, drafter, PROMPTS, max_new_tokens=40)
    assert res.sequences == greedy_generate(target, PROMPTS, 40)
    g = torch.Generator().manual_seed(0)
    res = speculative_generate(target, drafter, PROMPTS, max_new_tokens=20, temperature=0.8, generator=g)
    assert all(len(s) == 20 for s in res.sequences)


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def test_exports_back_bit_identically(zlab_dir, micro_target_dir, tmp_path):
    out = export_drafter(zlab_dir, tmp_path / "export", target=str(micro_target_dir))  # bf16, the default
    a, b = _tensors(zlab_dir), _tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.bfloat16, k
        assert torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)), k  # the same bits
    src, got = json.loads((zlab_dir / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert {k: got.get(k) for k in src} == src  # every z-lab field, same value
    assert set(got) - set(src) == {"dflash2", "dflash2_export", "rope_theta", "block_size"}  # ours, added
    card = (out / "README.md").read_text()
    assert "5 of 5 layer(s) sliding_attention, window 24" in card and "final_logit_softcapping 20.0" in card
    assert "`num_speculative_tokens` must equal `block_size − 1` = 15" in card
    # and loads back as the same drafter (the export records the target it was checked against)
    assert dataclasses.replace(load_drafter(out).config, target_name_or_path=None) == load_drafter(zlab_dir).config


def _edited(zlab_dir, tmp_path, edit):
    folder = shutil.copytree(zlab_dir, tmp_path / "edited")
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _pop(*path):
    def edit(cfg):
        for key in path[:-1]:
            cfg = cfg[key]
        cfg.pop(path[-1])

    return edit


def _set(value, *path):
    def edit(cfg):
        for key in path[:-1]:
            cfg = cfg[key]
        cfg[path[-1]] = value

    return edit


def _move_cap_to_top(cfg):
    cfg["final_logit_softcapping"] = cfg["dflash_config"].pop("final_logit_softcapping")


@pytest.mark.parametrize(
    "edit,needle",
    [
        (_set(True, "is_causal"), r"layer\(s\) \[0, 1, 2, 3, 4\] attend causally .*is_causal / dflash_config.causal"),
        (_pop("is_causal"), r"attend causally inside the block \(sliding_attention without is_causal: false\)"),
        (_set(False, "use_sliding_window"), r"sliding_attention layers but no window is read .*use_sliding_window"),
        (_set(512, "dflash_config", "swa_window_size"), r"dflash_config.swa_window_size is not supported"),
        (_move_cap_to_top, r"final_logit_softcapping is at the top level, where vLLM does not read it"),
        (_set(8, "block_size"), r"block_size 8 and dflash_config.block_size 16 differ"),
        (_pop("dflash_config", "block_size"), r"has no 'block_size'"),
    ],
)
def test_what_engines_would_read_differently_is_refused(zlab_dir, tmp_path, edit, needle):
    folder = _edited(zlab_dir, tmp_path, edit)
    with pytest.raises(DFlash2Error, match=needle) as e:
        check_drafter_folder(folder)
    assert "\n" not in str(e.value) and str(folder / "config.json") in str(e.value)


@pytest.mark.parametrize(
    "edit,field",
    [
        (_set(16, "sliding_window"), "sliding_window"),
        (_set(["full_attention"] * 5, "layer_types"), "layer_types"),
        (_set(1.0, "dflash_config", "output_multiplier"), "output_multiplier"),
    ],
)
def test_hand_edits_of_our_exports_serving_fields_are_refused(zlab_dir, tmp_path, edit, field):
    """Engines never read our dflash2 section: serving fields that disagree with it would serve another drafter."""
    exported = export_drafter(zlab_dir, tmp_path / "export")
    folder = _edited(exported, tmp_path, edit)
    with pytest.raises(DFlash2Error, match=rf"serving fields give {field}=.* but the dflash2 section has"):
        load_drafter(folder)


@pytest.mark.slow
def test_the_fixture_fine_tunes_with_init_from(zlab_dir, micro_train_overrides, tmp_path):
    """python train.py drafter.init_from=<the fixture>: trains from it (bf16 folder, fp32 master weights)
    and saves a drafter with the same contract (block 16, sliding layers, scales, both additions)."""
    from test_train_drafter import compose_run

    from dflash2.training.run import run_from_config

    run_from_config(compose_run(tmp_path, [*micro_train_overrides, "drafter=dflash2", f"drafter.init_from={zlab_dir}"]))
    start, trained = load_drafter(zlab_dir), load_drafter(tmp_path / "run" / "drafter")
    assert dataclasses.replace(trained.config, training_data=None) == start.config  # + the run's data record
    moved = [k for k, v in trained.state_dict().items() if not torch.equal(v, start.state_dict()[k].float())]
    assert "fc.weight" in moved and "candidate_selector.successor_codebook" in moved
    assert all(torch.isfinite(v).all() for v in trained.state_dict().values())


@pytest.mark.slow
def test_our_own_drafter_trains_with_the_contract_fields_configured(micro_train_overrides, tmp_path):
    """The drafter config group sets the window and the scales; defaults stay full attention, no scaling."""
    from test_train_drafter import compose_run

    from dflash2.training.run import run_from_config

    overrides = [
        "drafter=dflash2",
        "drafter.layer_types=[sliding_attention]",
        "drafter.sliding_window=6",
        "drafter.input_embedding_scale=2.0",
        "drafter.output_multiplier=0.5",
        "drafter.final_logit_softcapping=20.0",
        "debug=fast_dev_run",
    ]
    summary = run_from_config(compose_run(tmp_path, [*micro_train_overrides, *overrides]))
    cfg = load_drafter(tmp_path / "run" / "drafter").config
    assert summary["drafter"]["steps"] >= 1
    assert cfg.layer_kinds == ["sliding_attention"] and cfg.sliding_window == 6
    assert cfg.serving_scales == {
        "input_embedding_scale": 2.0,
        "output_multiplier": 0.5,
        "final_logit_softcapping": 20.0,
    }
    written = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert written["is_causal"] is False and written["use_sliding_window"] is True
    assert written["dflash_config"]["final_logit_softcapping"] == 20.0
