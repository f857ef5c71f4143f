"""The verify's chunked recurrence (``chunked=True``: gdn_verify/chunk_kernel.py, twin chunked_reference.py).

The chunked form computes the block's outputs and logged u with matrix products and a triangular
solve instead of T dependent steps: the same values, summed in another order. So

* the twin == the sequential reference (reference.py) to CHUNKED (below), T = 1, 5, 16 and 37
  (three chunks, the state carried between them), and with gates strong enough that the cumulative
  decay underflows fp32 (the log-cumsum decays keep it finite);
* the kernel == the twin's exact values (its equations in float64) to TWIN, its own fp32 rounding,
  and == the sequential kernel to CHUNKED, its k / g logs bit for bit
  (same prep kernel); odd head dims and value slices narrower than a 16-wide tile (padded, masked);
  native ignores the option (bit for bit);
* its own knobs (chunk_warps, chunk_block_v, chunk_block_k) change the tiles, not the values: the
  same bounds with programs of several block_v slices, the last one past d_v, d_k slices of which the
  last is partly padding, T = 2 and 9 (one chunk) and 33 (the state carried twice, the second time
  through the scratch copy it reads);
* the deferred fold is unchanged: with reserved logs each verify folds the previous commit's ragged
  n (0, 3, T) exactly as the commit kernel does, so outputs, logs and states are bit for bit those
  of the eager path through the same option, and every program zeroes the counts of its own block_v
  slices (a program of four slices where d_v has two must not zero the next head's);
* verify + commit(n) == decoding n tokens one at a time (the plain-PyTorch loop) to CHUNKED.

CPU cases run in Triton's interpreter (a verify of these shapes takes about a second).
"""

import pytest
import torch
from test_runtime_gdn_kernels import DEVICES, GQA, GQA_CPU, _after, _decode, _gdn_state, _inputs, _steps, make_case

from dflash2.runtime.kernels.gdn_verify import gdn_verify_triton
from dflash2.runtime.kernels.gdn_verify.chunked_reference import gdn_verify_chunked_reference
from dflash2.runtime.kernels.gdn_verify.reference import gdn_verify_reference

# The chunked and the sequential forms sum the same fp32 terms in different orders (a 16 × 16
# solve and d_k-long dot products instead of T interleaved updates): differences seen on these O(1)
# values are ≤ 3e-6 after 16 tokens. 1e-4 relative / 2e-5 absolute leaves room for the GPU's dot
# order, while a misplaced β or decay (a real bug) moves values by 1e-2 and more.
CHUNKED = dict(rtol=1e-4, atol=2e-5)
# The kernel against the chunk equations evaluated in float64 (the twin's dtype=float64): only the
# kernel's own fp32 rounding, ≤ 1.2e-6 after one chunk and ≤ 2.1e-6 after three on these values
# (the fp32 twin is as far from float64 on its own, so fp32 kernel vs fp32 twin would need CHUNKED).
TWIN = dict(rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("T", [1, 5, 16, 37])
def test_twin_matches_the_sequential_reference(T):
    case = make_case(3, T, GQA, seed=T)
    o_ref, log_ref = gdn_verify_reference(**case)
    o, log = gdn_verify_chunked_reference(**case)
    torch.testing.assert_close(o, o_ref, **CHUNKED)
    torch.testing.assert_close(log.u, log_ref.u, **CHUNKED)
    assert torch.equal(log.k, log_ref.k) and torch.equal(log.g, log_ref.g)


def test_twin_with_vanishing_decay():
    """Gates of g ≈ −100 per token: the products γ_t underflow to 0 within a chunk and their ratios
    would be 0/0; the decays as exp of log-gate sums stay finite and the outputs match."""
    case = make_case(2, 16, GQA, seed=3)
    case["a"] = case["a"].abs() + 60.0
    case["A_log"] = case["A_log"].abs() + 0.5
    o_ref, log_ref = gdn_verify_reference(**case)
    assert log_ref.g.min() < -90
    o, log = gdn_verify_chunked_reference(**case)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, **CHUNKED)
    torch.testing.assert_close(log.u, log_ref.u, **CHUNKED)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T, heads, tiles",
    [
        (1, GQA, {}),  # AR decode: one token runs the sequential walk (a chunk pays only for T > 1)
        (5, GQA, dict(block_v=4)),  # odd head dims, 2 value slices per head (4 columns in a 16-wide tile)
        (16, (3, 3, 9, 5), {}),  # a full chunk, one key head per value head
        (37, (1, 2, 16, 16), {}),  # three chunks (prefill length): the state carried by the kernel
    ],
)
def test_kernel_matches_twin_and_sequential(device, T, heads, tiles):
    case = make_case(3 if T < 16 else 2, T, heads, device=device, seed=T)
    before = (case["conv_state"].clone(), case["rec_state"].clone())
    o, log = gdn_verify_triton(**case, chunked=True, **tiles)
    o_twin, log_twin = gdn_verify_chunked_reference(**case, dtype=torch.float64)
    o_seq, log_seq = gdn_verify_triton(**case, **tiles)
    # against its twin's exact values to its own fp32 rounding; against the sequential kernel to CHUNKED
    torch.testing.assert_close(o.double(), o_twin, **TWIN)
    torch.testing.assert_close(log.u.double(), log_twin.u, **TWIN)
    torch.testing.assert_close(o, o_seq, **CHUNKED)
    torch.testing.assert_close(log.u, log_seq.u, **CHUNKED)
    # the same prep kernel wrote k and g
    assert torch.equal(log.k, log_seq.k) and torch.equal(log.g, log_seq.g)
    assert torch.equal(case["conv_state"], before[0]) and torch.equal(case["rec_state"], before[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T, heads, tiles",
    [
        # odd head dims, one program over both block_v slices of a head, 2 warps
        (2, GQA, dict(block_v=4, chunk_block_v=8, chunk_warps=2)),
        # d_k 40: the last of three 16-row slices of S0 is half padding; d_v 24 in programs of 16 columns,
        # the second over block_v slice 2 and one past d_v
        (9, (1, 2, 40, 24), dict(block_v=8, chunk_block_v=16, chunk_block_k=16)),
        # three chunks: S carried from rec to the scratch, then from the scratch onto itself
        (33, (1, 2, 20, 12), dict(block_v=4, chunk_block_v=8, chunk_block_k=16, chunk_warps=1)),
        # a d_k slice wider than d_k (clamped to the padded 16), 8 warps
        (16, GQA, dict(chunk_block_k=64, chunk_warps=8)),
    ],
)
def test_kernel_knobs_match_twin_and_sequential(device, T, heads, tiles):
    case = make_case(2, T, heads, device=device, seed=100 + T)
    before = (case["conv_state"].clone(), case["rec_state"].clone())
    o, log = gdn_verify_triton(**case, chunked=True, **tiles)
    o_twin, log_twin = gdn_verify_chunked_reference(**case, dtype=torch.float64)
    o_seq, log_seq = gdn_verify_triton(**case, block_v=tiles.get("block_v"))
    torch.testing.assert_close(o.double(), o_twin, **TWIN)
    torch.testing.assert_close(log.u.double(), log_twin.u, **TWIN)
    torch.testing.assert_close(o, o_seq, **CHUNKED)
    torch.testing.assert_close(log.u, log_seq.u, **CHUNKED)
    assert torch.equal(log.k, log_seq.k) and torch.equal(log.g, log_seq.g)
    assert torch.equal(case["conv_state"], before[0]) and torch.equal(case["rec_state"], before[1])


def test_chunk_block_v_must_hold_whole_slices():
    """A program of chunk_block_v columns folds and zeroes whole block_v slices' counts: two programs
    sharing a slice would race on its count (one zeroes it before the other reads it)."""
    case = make_case(1, 2, GQA)
    with pytest.raises(ValueError, match="multiple of block_v"):
        gdn_verify_triton(**case, chunked=True, block_v=8, chunk_block_v=4)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_with_vanishing_decay(device):
    case = make_case(2, 16, GQA, device=device, seed=3)
    case["a"] = case["a"].abs() + 60.0
    case["A_log"] = case["A_log"].abs() + 0.5
    o, log = gdn_verify_triton(**case, chunked=True)
    o_ref, log_ref = gdn_verify_reference(**case)
    assert torch.isfinite(o).all() and torch.isfinite(log.u).all()
    torch.testing.assert_close(o, o_ref, **CHUNKED)
    torch.testing.assert_close(log.u, log_ref.u, **CHUNKED)


def _strong_then_weak(case):
    """Log gates of −130 to −810 on tokens 0-3 and the case's own (≥ −50) after: the chunk's running sum of
    log gates is then large while later tokens' decays are moderate, where exp(G_t − G_s) would lose
    |G|·2⁻²⁴ of each exponent (the decays are summed per segment instead)."""
    case["a"][:, :4] = case["a"][:, :4].abs() + 400.0
    return case


def test_twin_with_strong_gates_then_weak_ones():
    case = _strong_then_weak(make_case(2, 16, GQA, seed=5))
    o_ref, log_ref = gdn_verify_reference(**case)
    assert log_ref.g[:, :4].max() < -100 and log_ref.g[:, 4:].min() > -50
    o, log = gdn_verify_chunked_reference(**case)
    torch.testing.assert_close(o, o_ref, **CHUNKED)
    torch.testing.assert_close(log.u, log_ref.u, **CHUNKED)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_with_strong_gates_then_weak_ones(device):
    case = _strong_then_weak(make_case(2, 16, GQA, device=device, seed=5))
    o, log = gdn_verify_triton(**case, chunked=True)
    o_twin, log_twin = gdn_verify_chunked_reference(**case, dtype=torch.float64)
    o_ref, log_ref = gdn_verify_reference(**case)
    torch.testing.assert_close(o.double(), o_twin, **TWIN)
    torch.testing.assert_close(log.u.double(), log_twin.u, **TWIN)
    torch.testing.assert_close(o, o_ref, **CHUNKED)
    torch.testing.assert_close(log.u, log_ref.u, **CHUNKED)


@pytest.mark.parametrize("device", DEVICES)
def test_native_ignores_the_option(device):
    """Native rollback stores the state after every token, which is the sequential walk: unchanged."""
    case = make_case(2, 5, GQA, device=device, seed=7)
    o0, log0 = gdn_verify_triton(**case, native=True)
    o, log = gdn_verify_triton(**case, native=True, chunked=True)
    assert torch.equal(o, o0) and torch.equal(log.states, log0.states)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T, heads, tiles",
    [
        (5, GQA_CPU, dict(block_v=4)),
        (16, GQA_CPU, {}),
        # d_v 24 has three block_v slices and two programs of two: the second reads and zeroes slice 2's
        # count, and must not zero the one past d_v (the next head's first)
        (5, (1, 2, 5, 24), dict(block_v=8, chunk_block_v=16, chunk_warps=2)),
    ],
)
def test_deferred_fold_equals_eager_fold(device, T, heads, tiles):
    """Reserved logs: every verify folds the previous commit's pending n (ragged: 0, 3 and T across rows,
    and each row 0 once) with the unchanged exact fold, then runs the chunked block. Against the eager
    path through the same option (the commit kernel folds at once): outputs, logs and states bit for
    bit, step after step, and after flush()."""
    N = 3
    opts = dict(chunked=True, **tiles)
    start = make_case(N, T, heads, device=device, seed=60 + T)
    eager = _gdn_state(start, "replay", kernel_options=opts)
    lazy = _gdn_state(start, "replay", kernel_options=opts)
    lazy.reserve(T)
    schedule = [[0, 3, T], [T, 0, 3], [3, T, 0]]
    for args, n in zip(_steps(N, T, heads, 1, len(schedule), device, seed=T), schedule):
        assert torch.equal(eager.verify(0, *args[0]), lazy.verify(0, *args[0]))
        assert not lazy._pend[T].any()  # every program zeroed the counts of its own slices, and only those
        for name in ("x", "k", "u", "g"):
            assert torch.equal(getattr(eager.logs[0], name), getattr(lazy.logs[0], name)), name
        assert torch.equal(eager.rec, lazy.rec) and torch.equal(eager.conv, lazy.conv)
        n = torch.tensor(n, device=device)
        eager.commit(n)
        lazy.commit(n)
    lazy.flush()
    assert torch.equal(eager.rec, lazy.rec) and torch.equal(eager.conv, lazy.conv)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_equals_single_token_decoding(device):
    """verify(T) through the chunked kernel + commit(n) == n tokens decoded one at a time by the
    plain-PyTorch loop, ragged n = 0, 1, 3, T (conv window: a copy, exact)."""
    N, T = 4, 5
    case = make_case(N, T, GQA_CPU, device=device, seed=90)
    n = torch.tensor([0, 1, 3, T], device=device)
    conv_ref, rec_ref, _ = _decode(case, "reference")
    s = _gdn_state(case, "replay", kernel_options=dict(chunked=True))
    s.verify(0, *_inputs(case))
    s.commit(n)
    torch.testing.assert_close(s.rec[0], _after(rec_ref, n), **CHUNKED)
    torch.testing.assert_close(s.conv[0], _after(conv_ref, n), rtol=0, atol=0)
    assert torch.equal(s.rec[0, 0], case["rec_state"][0])  # n = 0: untouched
