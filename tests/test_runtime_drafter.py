"""The runtime drafter (dflash2.runtime.drafter) against the reference DFlashProposer (dflash2.decoding).

Both get the same drafter weights, the same target (HF for the reference, its runtime
twin loaded from the saved folder) and the same taps. A ragged batch of 4 rows is
prefilled with different prompt lengths and then grows its context by a different
number of positions per row per step, as verify steps leave it; at every step the
runtime's hidden states, drafts and proposal distributions must equal the reference's.
v1 drafters and DFlash2 drafters whose conv and selector are moved off their
(identity / near-argmax) init, so that both additions really act.
"""

import pytest
import torch
from conftest import nontrivial_dflash2, spec_drafter

from dflash2.decoding import DFlashProposer, SamplingParams
from dflash2.drafter import save_drafter
from dflash2.errors import DFlash2Error
from dflash2.runtime import load_model
from dflash2.runtime.drafter import RuntimeDrafter

PROMPT_LENS = [5, 11, 2, 8]
# (block tokens whose taps are appended, how many each row keeps): like verify steps of B = 8
APPENDS = [(8, [3, 1, 8, 2]), (8, [1, 1, 1, 1]), (8, [8, 5, 2, 7])]
TAPS = [0, 1]


@pytest.fixture(scope="module")
def pair(hf_targets):
    """(reference TargetModel over the HF Qwen3, its runtime twin) with taps at TAPS."""
    from dflash2.target import TargetModel

    hf, folder = hf_targets["qwen3"]
    return TargetModel(hf, target_layer_ids=TAPS), load_model(folder, target_layer_ids=TAPS)


# the published DFlash2 contract (ARCHITECTURE.md §3.4): a window narrower than the contexts, all three scales
CONTRACT = dict(
    layer_types=["sliding_attention"],
    sliding_window=6,
    input_embedding_scale=1.5,
    output_multiplier=0.5,
    final_logit_softcapping=2.0,
)


def _drafter(target, block_size, v2, contract=False):
    drafter = spec_drafter(target, block_size, v2=v2, seed=3)
    if contract:
        import dataclasses

        from dflash2.drafter import DFlashDrafter

        windowed = DFlashDrafter(dataclasses.replace(drafter.config, **CONTRACT)).eval()
        windowed.load_state_dict(drafter.state_dict())
        drafter = windowed
    return nontrivial_dflash2(drafter) if v2 else drafter


def _walk(ref: DFlashProposer, run: RuntimeDrafter, runtime_model, check):
    """Prefill both contexts, then per step: check(anchor, pos, ctx), append the same ragged taps."""
    N = len(PROMPT_LENS)
    seqs = torch.randint(0, 120, (N, 48), generator=torch.Generator().manual_seed(0))
    taps = runtime_model(seqs, runtime_model.new_state(N, 64)).taps  # (N, 48, K·d): causal, any prefix
    lens = torch.tensor(PROMPT_LENS)
    P = max(PROMPT_LENS)
    ctx = run.new_context(N, 64)
    ref.add_context(taps[:, :P], torch.arange(P).expand(N, -1), lens)
    run.append(ctx, taps[:, :P], lens)
    pos = lens.clone()
    for T, keep in [*APPENDS, (0, None)]:
        assert torch.equal(ctx.lengths, pos) and torch.equal(ref.cache.lengths, pos)
        check(seqs.gather(1, pos[:, None])[:, 0], pos, ctx)
        if not T:
            break
        positions = pos[:, None] + torch.arange(T)  # (N, T): each row's next T positions
        new = taps.gather(1, positions[..., None].expand(-1, -1, taps.shape[-1]))
        n = torch.tensor(keep)
        ref.add_context(new, positions, n)
        run.append(ctx, new, n)
        pos = pos + n


@pytest.mark.parametrize("v2,contract", [(False, False), (True, False), (True, True)], ids=["v1", "dflash2", "window"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_greedy_drafts_equal_the_reference(pair, v2, contract, block_size):
    target, runtime_model = pair
    drafter = _drafter(target, block_size, v2, contract)
    ref, run = DFlashProposer(drafter, target), RuntimeDrafter(drafter, runtime_model)
    greedy = SamplingParams()
    seen = {"steps": 0, "argmax_differs": False}

    def check(anchor, pos, ctx):
        B = block_size
        embeds = drafter.embed_block(
            torch.cat([anchor[:, None], torch.full((4, B - 1), drafter.config.mask_token_id)], 1), target.embed_tokens
        )
        ref_h = drafter.draft_block(embeds, pos[:, None] + torch.arange(B), ref.cache)
        torch.testing.assert_close(run.hidden(ctx, anchor), ref_h, rtol=0, atol=2e-5)
        drafts = run.propose(ctx, anchor, greedy)
        assert drafts.ids is None and drafts.dense is None  # T=0: no q at all
        assert torch.equal(drafts.tokens, ref.propose(anchor, pos, greedy, None)[0])
        # a bounded kv_len (what the engine passes) reads less of the cache and drafts the same
        bounded = run.propose(ctx, anchor, greedy, kv_len=int(pos.max()) + B)
        assert torch.equal(bounded.tokens, drafts.tokens)
        plain = target.lm_head(ref_h[:, 1:]).argmax(-1)
        seen["argmax_differs"] |= not torch.equal(plain, drafts.tokens)
        seen["steps"] += 1

    _walk(ref, run, runtime_model, check)
    assert seen["steps"] == len(APPENDS) + 1
    assert seen["argmax_differs"] == v2  # the selector's path is not the plain argmax (and v1's is)


@pytest.mark.parametrize("v2,contract", [(False, False), (True, False), (False, True)], ids=["v1", "dflash2", "window"])
def test_sampled_proposals_equal_the_reference(pair, v2, contract):
    """T>0: the same draws for the same generator; q dense for v1, sparse over the selector's k for v2."""
    target, runtime_model = pair
    drafter = _drafter(target, 8, v2, contract)
    ref, run = DFlashProposer(drafter, target), RuntimeDrafter(drafter, runtime_model)
    params = SamplingParams(0.9, top_k=20)
    V = runtime_model.vocab_size

    def check(anchor, pos, ctx):
        got = run.propose(ctx, anchor, params, torch.Generator().manual_seed(11))
        tokens, q = ref.propose(anchor, pos, params, torch.Generator().manual_seed(11))
        assert torch.equal(got.tokens, tokens)
        if v2:
            assert got.dense is None and got.ids.shape == (4, 7, drafter.config.selector_top_k)
        else:
            assert got.ids is None and got.dense.shape == (4, 7, V)
        torch.testing.assert_close(got.densify(V), q, rtol=0, atol=1e-6)
        # argmax drafts at T>0: the greedy drafts as point masses (one id, probability 1)
        point = run.propose(ctx, anchor, params, argmax_drafts=True)
        assert torch.equal(point.tokens, run.propose(ctx, anchor, SamplingParams()).tokens)
        assert point.ids.shape == (4, 7, 1) and bool((point.probs == 1).all())

    _walk(ref, run, runtime_model, check)


def test_loads_an_exported_folder(pair, tmp_path):
    target, runtime_model = pair
    drafter = _drafter(target, 4, v2=True)
    save_drafter(drafter, tmp_path / "d")
    from_folder, from_module = RuntimeDrafter(tmp_path / "d", runtime_model), RuntimeDrafter(drafter, runtime_model)
    assert from_folder.drafter is not drafter and from_folder.block_size == 4
    outs = []
    for run in (from_folder, from_module):
        ctx = run.new_context(2, 32)
        taps = runtime_model(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), runtime_model.new_state(2, 32)).taps
        run.append(ctx, taps, torch.tensor([4, 3]))
        outs.append(run.propose(ctx, torch.tensor([1, 2]), SamplingParams()).tokens)
    assert torch.equal(*outs)


def test_refuses_a_target_tapping_other_layers(pair, hf_targets):
    target, _ = pair
    drafter = _drafter(target, 4, v2=False)
    with pytest.raises(DFlash2Error, match=r"target_layer_ids=\[0, 1\]"):
        RuntimeDrafter(drafter, load_model(hf_targets["qwen3"][1], target_layer_ids=[1]))
    with pytest.raises(DFlash2Error, match="must be a DFlashDrafter"):
        RuntimeDrafter(object(), load_model(hf_targets["qwen3"][1], target_layer_ids=[0, 1]))
