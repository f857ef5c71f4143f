"""Gated DeltaNet verify / commit (dflash2.runtime.gdn_state) against token-by-token decoding and HF.

The ReplaySSM contract: ``verify`` of T tokens from the untouched state followed by
``commit(n)`` must leave exactly the state that feeding the first n[r] tokens of row r
one at a time leaves — for every n in 1..T ("zero drafts accepted" still commits the
one corrected token) and for a different n per row — and verify's outputs must be
the token-by-token outputs.
"""

import pytest
import torch

from dflash2.runtime.gdn_state import GDNState, gdn_gates, gdn_verify
from dflash2.runtime.kernels.triton_util import interpreting

N, T, K = 3, 6, 4
HK, H, DK, DV = 2, 4, 8, 8  # 2 key heads serve 4 value heads, as in the GQA-style GDN configs
C = 2 * HK * DK + H * DV


def _inputs(seed: int, steps: int = T):
    """x, conv weight, and the gate inputs (a, b, A_log, dt_bias) that GDNState.verify takes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, steps, C, generator=g)
    conv_weight = 0.5 * torch.randn(C, 1, K, generator=g)
    a, b = torch.randn(N, steps, H, generator=g), torch.randn(N, steps, H, generator=g)
    gates = (a, b, 0.5 * torch.randn(H, generator=g), torch.randn(H, generator=g))  # a, b, A_log, dt_bias
    return x, conv_weight, gates


def _at(gates, t):
    """The gate inputs of block token t alone."""
    a, b, A_log, dt_bias = gates
    return a[:, t : t + 1], b[:, t : t + 1], A_log, dt_bias


def _state(seed: int, mode: str = "reference") -> GDNState:
    """A state that already holds some history (non-zero conv window and recurrent state)."""
    s = GDNState(
        1,
        N,
        conv_dim=C,
        conv_kernel=K,
        num_k_heads=HK,
        num_v_heads=H,
        head_k_dim=DK,
        head_v_dim=DV,
        dtype=torch.float32,
        device="cpu",
        mode=mode,
    )
    g = torch.Generator().manual_seed(seed)
    s.conv.copy_(torch.randn(s.conv.shape, generator=g))
    s.rec.copy_(0.3 * torch.randn(s.rec.shape, generator=g))
    return s


def _clone(s: GDNState) -> GDNState:
    c = _state(0)
    c.conv.copy_(s.conv)
    c.rec.copy_(s.rec)
    return c


def _token_by_token(s: GDNState, x, w, gates, n: torch.Tensor) -> torch.Tensor:
    """Feed tokens one at a time (verify 1 + commit 1); row r stops after n[r]. Returns o (N, T, H, DV)."""
    outs = []
    for t in range(x.shape[1]):
        outs.append(s.verify(0, x[:, t : t + 1], w, *_at(gates, t)))
        s.commit((t < n).long())
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("n", [[k] * N for k in range(1, T + 1)] + [[1, 4, 6], [6, 2, 1], [0, 3, 5]])
def test_verify_then_commit_equals_token_by_token(n):
    n = torch.tensor(n)
    x, w, gates = _inputs(seed=1)
    spec, ref = _state(2), _state(2)
    o_verify = spec.verify(0, x, w, *gates)
    before = (spec.conv.clone(), spec.rec.clone())
    assert torch.equal(spec.conv, ref.conv) and torch.equal(spec.rec, ref.rec)  # verify wrote nothing
    spec.commit(n)
    o_steps = _token_by_token(ref, x, w, gates, n)
    # replay repeats verify's two updates in the same order: the fold is exact in practice (≤ 1 ulp)
    torch.testing.assert_close(spec.rec, ref.rec, rtol=0, atol=1e-6)
    torch.testing.assert_close(spec.conv, ref.conv, rtol=0, atol=0)  # a copy of inputs: exact
    # every token's output equals the token-by-token output (rows past n[r] too, when fed in full)
    full = _token_by_token(_state(2), x, w, gates, torch.full((N,), T))
    torch.testing.assert_close(o_verify, full, rtol=0, atol=1e-6)
    torch.testing.assert_close(o_verify[:, :1], o_steps[:, :1], rtol=0, atol=1e-6)
    zero = n == 0  # rows that took no part keep their state
    assert torch.equal(spec.rec[0, zero], before[1][0, zero]) and torch.equal(spec.conv[0, zero], before[0][0, zero])


def test_conv_window_after_commit_is_last_inputs():
    """New window = last K-1 columns of [old window | x_1 .. x_n] for each row's own n."""
    x, w, gates = _inputs(seed=3)
    s = _state(4)
    old = s.conv[0].clone()
    s.verify(0, x, w, *gates)
    n = torch.tensor([1, 2, 6])
    s.commit(n)
    for r in range(N):
        seq = torch.cat([old[r], x[r].T], dim=-1)  # (C, K-1+T)
        k = int(n[r])
        torch.testing.assert_close(s.conv[0, r], seq[:, k : k + K - 1], rtol=0, atol=0)


def test_commit_needs_a_verify():
    s = _state(0)
    with pytest.raises(RuntimeError, match="without a verify"):
        s.commit(torch.ones(N, dtype=torch.long))


def test_gdn_verify_matches_hf_functions():
    """Against transformers' own plain-PyTorch GDN functions (causal_conv1d_update +
    torch_recurrent_gated_delta_rule with qk L2 norm): same outputs and same final states."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    x, w, gates = _inputs(seed=5)
    decay, beta = gdn_gates(*gates)
    s = _state(6)
    conv0, rec0 = s.conv[0].clone(), s.rec[0].clone()
    o = s.verify(0, x, w, *gates)
    s.commit(torch.full((N,), T))
    # HF keeps K conv columns (the oldest is never read); its update writes the state in place
    hf_conv = torch.cat([torch.zeros(N, C, 1), conv0], dim=-1)
    y = hf.causal_conv1d_update(x.transpose(1, 2), hf_conv, w.squeeze(1), None, "silu").transpose(1, 2)
    q, k, v = y.split([HK * DK, HK * DK, H * DV], dim=-1)
    # value head h reads key head h // (H / HK); repeated here as the HF model does before the call (older
    # transformers, e.g. 5.17 on the GPU image, take H key heads; newer ones also take HK)
    q, k = (t.reshape(N, T, HK, DK).repeat_interleave(H // HK, dim=2) for t in (q, k))
    o_hf, rec_hf = hf.torch_recurrent_gated_delta_rule(
        q,
        k,
        v.reshape(N, T, H, DV),
        g=decay,
        beta=beta,
        initial_state=rec0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, o_hf, rtol=0, atol=1e-6)
    torch.testing.assert_close(s.rec[0], rec_hf, rtol=0, atol=1e-6)
    torch.testing.assert_close(s.conv[0], hf_conv[..., 1:], rtol=0, atol=0)


def test_a_tokens_gates_do_not_depend_on_its_block():
    """Token t's decay and β have the same bits in a block of any length as alone (an AR step): a prefill
    padded to a bucket and a verify block see the same gates as single-token decoding. (One call over
    (N, T, H) did not: ATen's vectorised softplus / sigmoid and its scalar tail round differently.)"""
    g = torch.Generator().manual_seed(3)
    for n, h in ((1, 3), (3, 4), (4, 7)):
        proj = torch.randn(n, 23, 2 * h + 5, generator=g)  # a, b as slices of a fused projection, as the model
        a_log, dt_bias = torch.randn(h, generator=g), torch.randn(h, generator=g)
        for T in (2, 16, 23):
            a, b = proj[:, :T, 5 : 5 + h], proj[:, :T, 5 + h :]
            decay, beta = gdn_gates(a, b, a_log, dt_bias)
            for t in range(T):
                one = gdn_gates(a[:, t : t + 1], b[:, t : t + 1], a_log, dt_bias)
                assert torch.equal(one[0][:, 0], decay[:, t]) and torch.equal(one[1][:, 0], beta[:, t]), (n, h, T, t)


def test_verify_keeps_bf16_inputs_and_fp32_state():
    """Model-dtype logs/outputs, fp32 recurrence: o comes back in x's dtype, the state stays fp32."""
    x, w, gates = _inputs(seed=7)
    decay, beta = gdn_gates(*gates)
    s = _state(8)
    o, log = gdn_verify(x.bfloat16(), s.conv[0].bfloat16(), w.bfloat16(), s.rec[0], decay, beta.bfloat16(), HK, DK)
    assert o.dtype == torch.bfloat16 and log.u.dtype == log.k.dtype == log.g.dtype == torch.float32
    assert log.x.dtype == torch.bfloat16


def _same(a: GDNState, b: GDNState) -> bool:
    return torch.equal(a.conv, b.conv) and torch.equal(a.rec, b.rec)


@pytest.mark.skipif(not interpreting(), reason="the Triton modes on CPU tensors need TRITON_INTERPRET=1")
def test_flush_is_idempotent_and_a_no_op_without_a_pending_fold(monkeypatch):
    """GDNState.flush(): without a pending (deferred) commit it changes nothing and launches nothing — a
    fresh state, after a verify alone, after a flush; with one it folds exactly what the eager commit
    folds (one commit-kernel launch per layer), and a second flush or the next verify adds nothing.
    Modes that never defer (reference, native, replay without reserved logs) commit at once."""
    from dflash2.runtime.kernels import gdn_replay

    launches = []
    kernel = gdn_replay.gdn_replay_triton
    monkeypatch.setattr(gdn_replay, "gdn_replay_triton", lambda *a, **kw: launches.append(1) or kernel(*a, **kw))
    x, w, gates = _inputs(seed=11)
    x2, _, gates2 = _inputs(seed=12)
    lazy, eager = _state(13, "replay"), _state(13, "replay")  # eager: no reserved logs, the commit folds at once
    lazy.reserve(T)
    start = _clone(lazy)
    lazy.flush()
    assert _same(lazy, start) and not launches  # fresh: nothing pending
    o = lazy.verify(0, x, w, *gates)
    assert torch.equal(o, eager.verify(0, x, w, *gates))
    lazy.flush()
    assert _same(lazy, start) and not launches  # a verify alone leaves nothing to fold
    n = torch.tensor([0, 4, T])
    lazy.commit(n)
    eager.commit(n)
    # only the eager state folded; the lazy one waits (its commit rolled the window: that is not a fold)
    assert len(launches) == 1 and torch.equal(lazy.rec, start.rec) and not torch.equal(eager.rec, start.rec)
    assert torch.equal(lazy.conv, eager.conv)
    lazy.flush()
    assert len(launches) == 2 and _same(lazy, eager)
    lazy.flush()
    assert len(launches) == 2 and _same(lazy, eager)  # idempotent
    assert torch.equal(lazy.verify(0, x2, w, *gates2), eager.verify(0, x2, w, *gates2))
    assert _same(lazy, eager)  # the verify after a flush folds nothing more
    lazy.commit(n, defer=False)  # a prefill's commit: folded at once even into reserved logs
    eager.commit(n)
    assert len(launches) == 4 and _same(lazy, eager) and lazy._deferred is None
    lazy.flush()
    assert len(launches) == 4
    for mode in ("reference", "native"):
        s, ref = _state(13, mode), _state(13, mode)
        s.reserve(T)
        s.verify(0, x, w, *gates)
        ref.verify(0, x, w, *gates)
        s.commit(n)
        ref.commit(n)
        assert not _same(s, start) and _same(s, ref), mode  # committed at once
        s.flush()
        assert _same(s, ref), mode


def test_block_v_narrows_until_the_recurrence_fills_the_sms():
    """The pair's GDN shape (8 value heads, d_v 96) on 132 SMs: 48 programs at 16, 96 at 8, 192 at 4; the 9B
    shape (32 heads, d_v 128) has 256 at 16 and keeps it; never below 4, never above d_v's power of two."""
    from dflash2.runtime.kernels.gdn_log import occupancy_block_v, recur_programs

    assert occupancy_block_v(1, 8, 96, 132) == 4 and recur_programs(8, 96, 4) == 192
    assert occupancy_block_v(8, 8, 96, 132) == 16  # 384 programs
    assert occupancy_block_v(2, 8, 96, 132) == 8  # 96 at 16, 192 at 8
    assert occupancy_block_v(1, 32, 128, 132) == 16
    assert occupancy_block_v(1, 1, 8, 10_000) == 4
    assert occupancy_block_v(64, 4, 4, 1) == 4  # d_v 4: its own power of two


def test_prep_chunks_shorten_while_a_block_prep_leaves_sms_idle():
    """The 9B shape (16 key heads, 32 value heads: 64 prep programs per row) on 132 SMs: 4-token chunks at 1 and
    2 rows (64, 128 programs), 16 from 3 rows (192); this file's shape (2 key heads, 4 value heads: 8 per row)
    keeps 4 up to 16 rows (128 programs)."""
    from dflash2.runtime.kernels.gdn_verify import NARROW_PREP_TOKENS, PREP_TOKENS, occupancy_block_t

    assert (NARROW_PREP_TOKENS, PREP_TOKENS) == (4, 16)
    assert occupancy_block_t(1, 16, 32, 132) == 4 and occupancy_block_t(2, 16, 32, 132) == 4
    assert occupancy_block_t(3, 16, 32, 132) == 16 and occupancy_block_t(64, 16, 32, 132) == 16
    assert occupancy_block_t(16, 2, 4, 132) == 4 and occupancy_block_t(17, 2, 4, 132) == 16


@pytest.mark.cuda
def test_a_cuda_state_picks_its_block_v_and_block_t_unless_given():
    kw = dict(
        conv_dim=C, conv_kernel=K, num_k_heads=HK, num_v_heads=H, head_k_dim=DK, head_v_dim=DV, dtype=torch.float32
    )
    # 1 row × 4 heads × 8/4: 8 recurrence programs and 2·2 + 4 = 8 prep programs, fewer than any GPU's SMs
    picked = GDNState(1, 1, device="cuda", mode="replay", **kw)
    assert picked.kernel_options == {"block_v": 4, "block_t": 4}
    given = GDNState(1, 1, device="cuda", mode="native", kernel_options={"block_v": 8, "block_t": 16}, **kw)
    assert given.kernel_options == {"block_v": 8, "block_t": 16}
    one = GDNState(1, 1, device="cuda", mode="replay", kernel_options={"one_launch": True}, **kw)
    assert one.kernel_options == {"one_launch": True, "block_v": 4}  # one_launch picks its own prep chunks
    assert GDNState(1, 1, device="cuda", mode="reference", **kw).kernel_options == {}


@pytest.mark.cuda
def test_the_chunked_recurrence_keeps_its_own_tile():
    """A narrowed block_v must not narrow the chunked recurrence's tile (its chunk_block_v defaults to block_v)."""
    kw = dict(
        conv_dim=C, conv_kernel=K, num_k_heads=HK, num_v_heads=H, head_k_dim=DK, head_v_dim=DV, dtype=torch.float32
    )
    s = GDNState(1, 1, device="cuda", mode="replay", kernel_options={"chunked": True}, **kw)
    assert s.kernel_options == {"chunked": True, "block_v": 4, "block_t": 4, "chunk_block_v": 8}  # d_v 8
