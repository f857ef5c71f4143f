"""The ReplaySSM Triton kernels (dflash2/runtime/kernels/gdn_verify, gdn_replay) against their twins.

On random inputs with odd head dims, GQA-style heads (Hk < H) and equal heads, T = 1..16,
several value-dim slices per head and several token chunks per block (the kernels'
tiling), ragged n = 0..T across a batch:

* verify == the plain-PyTorch twin (outputs, ReplaySSM logs k / u / g, native per-position
  states) to fp32 rounding, and it writes neither state;
* commit == the twin; the conv window is a copy of inputs, so exactly equal;
* the exact fold: verify(T) + commit(n) leaves bit for bit the state that n single-token
  steps through the same kernels leave (verify(1) + commit(1)), and the u that the block
  verify logs is bit for bit what those single-token steps compute; native == replay;
* the pitfalls: n = 0 leaves a row untouched, n = 1 (no draft accepted: the one corrected
  token) commits exactly one token, n = T commits all of them;
* bf16 inputs with an fp32 state.

CPU cases run in Triton's interpreter (tests/conftest.py turns it on without a GPU); the
same cases run compiled on the GPU, marked ``cuda``. The interpreter runs a kernel's programs one
after the other, so the fold tests' CPU cases take the fewest heads and rows that keep each case's
layout (GQA_CPU: 2 value heads per key head), and their GPU cases the full ones (GQA, T = 16, 4 rows).
"""

import pytest
import torch

from dflash2.runtime.gdn_state import GDNState
from dflash2.runtime.kernels.gdn_replay import gdn_replay_triton
from dflash2.runtime.kernels.gdn_replay.reference import gdn_replay
from dflash2.runtime.kernels.gdn_verify import gdn_verify_triton
from dflash2.runtime.kernels.gdn_verify.reference import gdn_verify_reference
from dflash2.runtime.kernels.triton_util import interpreting

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
K = 4  # conv kernel, as every Qwen3.5 / Qwen3-Next config
GQA = (2, 4, 5, 7)  # Hk, H, d_k, d_v: 2 key heads serve 4 value heads, odd head dims
# the interpreter's GQA for the fold tests: 2 value heads per key head, odd head dims, half GQA's programs
# (two key heads' folds are interpreted in test_deferred_commit_across_block_lengths and in
# test_runtime_gdn_pipelined.py, and their verify / commit against the twins above)
GQA_CPU = (1, 2, 5, 7)
# fp32 rounding of a T ≤ 16 recurrence on O(1) values: errors seen are ~3e-7
F32 = dict(rtol=1e-5, atol=2e-6)


def per_device(cpu: list[tuple], cuda: list[tuple]) -> list:
    """(device, *case) parameters: the ``cpu`` cases run in the interpreter, the ``cuda`` ones compiled."""
    return [pytest.param(d.values[0], *c, marks=d.marks) for d, cases in zip(DEVICES, (cpu, cuda)) for c in cases]


def make_case(N, T, heads=GQA, dtype=torch.float32, device="cpu", seed=0) -> dict:
    """Random verify inputs; a spans softplus's threshold (a + dt_bias > 20) and tiny decays."""
    hk, h, dk, dv = heads
    C = 2 * hk * dk + h * dv
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dt)

    return dict(
        x=rnd(N, T, C),
        conv_state=rnd(N, C, K - 1),
        conv_weight=rnd(C, 1, K, scale=0.5),
        rec_state=rnd(N, h, dk, dv, scale=0.3, dt=torch.float32),
        a=rnd(N, T, h, scale=8.0),
        b=rnd(N, T, h, scale=2.0),
        A_log=rnd(h, scale=0.5),
        dt_bias=rnd(h),
        num_k_heads=hk,
    )


def _ragged_n(N, T, seed=0):
    """n per row in 0..T with 0 and T always present."""
    n = torch.randint(0, T + 1, (N,), generator=torch.Generator().manual_seed(seed))
    n[0], n[-1] = 0, T
    return n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("native", [False, True], ids=["replayssm", "native"])
@pytest.mark.parametrize(
    "T, heads, tiles",
    [
        (1, GQA, {}),  # AR decode
        (5, GQA, dict(block_v=4, block_t=2)),  # 2 value slices per head, 3 chunks (the last one short)
        (16, (3, 3, 9, 5), {}),  # block 16, one key head per value head
        (16, GQA, dict(block_v=4, block_t=4)),
    ],
)
def test_verify_kernel_matches_reference(device, native, T, heads, tiles):
    case = make_case(3 if T < 16 else 2, T, heads, device=device, seed=T)
    before = (case["conv_state"].clone(), case["rec_state"].clone())
    o, log = gdn_verify_triton(**case, native=native, **tiles)
    o_ref, log_ref = gdn_verify_reference(**case, native=native)
    torch.testing.assert_close(o, o_ref, **F32)
    assert log.x is case["x"] and log.native == native
    names = ("states",) if native else ("k", "u", "g")
    for name in names:
        torch.testing.assert_close(getattr(log, name), getattr(log_ref, name), **F32, msg=name)
    # verify only reads the states
    assert torch.equal(case["conv_state"], before[0]) and torch.equal(case["rec_state"], before[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("native", [False, True], ids=["replayssm", "native"])
@pytest.mark.parametrize("T, tiles", [(1, {}), (7, dict(block_v=4)), (16, {})])
def test_replay_kernel_matches_reference(device, native, T, tiles):
    N = 4
    case = make_case(N, T, device=device, seed=10 + T)
    _, log = gdn_verify_triton(**case, native=native)
    n = _ragged_n(N, T, seed=T).to(device)
    conv_ref, rec_ref = gdn_replay(case["conv_state"], case["rec_state"], log, n)
    conv, rec = case["conv_state"].clone(), case["rec_state"].clone()
    gdn_replay_triton(conv, rec, log, n, **tiles)
    torch.testing.assert_close(rec, rec_ref, **F32)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)  # a copy of inputs: exact
    # n = 0 (row 0): untouched, bit for bit
    assert torch.equal(rec[0], case["rec_state"][0]) and torch.equal(conv[0], case["conv_state"][0])


def _gdn_state(case, mode, layers=1, **kw) -> GDNState:
    """A state of ``layers`` GDN layers, each starting from the case's conv / recurrent state."""
    N, hk = case["x"].shape[0], case["num_k_heads"]
    h, dk, dv = case["rec_state"].shape[1:]
    s = GDNState(
        layers,
        N,
        conv_dim=case["x"].shape[-1],
        conv_kernel=K,
        num_k_heads=hk,
        num_v_heads=h,
        head_k_dim=dk,
        head_v_dim=dv,
        dtype=case["x"].dtype,
        device=case["x"].device,
        mode=mode,
        **kw,
    )
    s.conv.copy_(case["conv_state"].expand_as(s.conv))
    s.rec.copy_(case["rec_state"].expand_as(s.rec))
    return s


def _inputs(case, t=None):
    """GDNState.verify's arguments after the slot: the whole block, or block token t alone."""
    sl = slice(None) if t is None else slice(t, t + 1)
    return case["x"][:, sl], case["conv_weight"], case["a"][:, sl], case["b"][:, sl], case["A_log"], case["dt_bias"]


def _decode(case, mode, **kw):
    """Single-token decoding of the whole block: verify(1) + commit(1) per token (kw: GDNState's).

    Returns the states after t = 0..T tokens, conv (T+1, N, C, K-1) and rec (T+1, N, H, d_k, d_v),
    and the u each step logged (N, T, H, d_v) (None for the reference / native logs)."""
    s = _gdn_state(case, mode, **kw)
    N, T = case["x"].shape[:2]
    convs, recs, us = [s.conv[0].clone()], [s.rec[0].clone()], []
    for t in range(T):
        s.verify(0, *_inputs(case, t))
        us.append(s.logs[0].u)
        s.commit(torch.ones(N, dtype=torch.long, device=s.rec.device))
        convs.append(s.conv[0].clone())
        recs.append(s.rec[0].clone())
    return torch.stack(convs), torch.stack(recs), (torch.cat(us, dim=1) if mode == "replay" else None)


def _after(steps: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Row r of the state after n[r] tokens: steps (T+1, N, ...) -> (N, ...)."""
    return steps[n, torch.arange(n.shape[0], device=n.device)]


# T = 16 (a full 16-token prep chunk) runs on the GPU only: in the interpreter it is T = 9's code (one
# chunk, the same loops; the masks differ in value only), its verify and commit are checked at T = 16
# above, and its 18 interpreted verifies took ~18 s, a sixth of this file's time.
@pytest.mark.parametrize(
    "device, T, heads", per_device(cpu=[(3, GQA_CPU), (9, GQA_CPU)], cuda=[(3, GQA), (9, GQA), (16, GQA)])
)
def test_exact_fold_equals_single_token_decoding(device, T, heads):
    """ReplaySSM and native commits == decoding row r's n[r] tokens one at a time, for a ragged n with
    the pitfalls in it: n = 0 (row untouched), n = 1 (no draft accepted: the corrected token alone,
    exactly one token), n = T (full acceptance)."""
    N = 4
    case = make_case(N, T, heads, device=device, seed=20 + T)
    n = torch.tensor([0, 1, T // 2, T], device=device)
    conv_steps, rec_steps, u_steps = _decode(case, "replay")
    conv_ref, rec_ref, _ = _decode(case, "reference")
    for mode in ("replay", "native"):
        s = _gdn_state(case, mode)
        s.verify(0, *_inputs(case))
        if mode == "replay":
            # u_t depends on the state after the block's earlier tokens; verify's sequential walk
            # gives bit for bit what single-token decoding computes
            assert torch.equal(s.logs[0].u, u_steps)
        s.commit(n)
        assert torch.equal(s.rec[0], _after(rec_steps, n)), mode  # the exact fold: bit for bit
        assert torch.equal(s.conv[0], _after(conv_steps, n)), mode
        torch.testing.assert_close(s.rec[0], _after(rec_ref, n), **F32)  # plain-PyTorch decoding
        torch.testing.assert_close(s.conv[0], _after(conv_ref, n), rtol=0, atol=0)
    # each n commits a different state: one token is not zero and not two
    assert not torch.equal(rec_steps[1], rec_steps[0]) and not torch.equal(rec_steps[1], rec_steps[2])


@pytest.mark.parametrize("device, T, heads", per_device(cpu=[(3, GQA_CPU)], cuda=[(16, GQA), (9, (3, 3, 9, 5))]))
def test_bf16_block_verify_equals_single_token_decoding(device, T, heads):
    """What makes speculative output equal plain greedy output on a bf16 hybrid target, the GDN part: the
    engine's way (reserved logs, deferred commits), a T-token verify's bf16 outputs equal bit for bit those
    that T single-token steps (verify(1) + commit(1)) emit, and committing all T tokens then leaves bit for
    bit the decoded states. (bf16 rounds the conv output, SiLU and β: a different reduction order anywhere
    in the prep or the walk would show here as a one-ulp difference.)"""
    case = make_case(2, T, heads, dtype=torch.bfloat16, device=device, seed=30 + T)
    assert_block_verify_equals_single_token_decoding(case)


def assert_block_verify_equals_single_token_decoding(case, **state_kw):
    """The case's T-token verify + commit of all T tokens (reserved logs, deferred commit) against T
    single-token steps (verify(1) + commit(1)), both ReplaySSM states built with ``state_kw``: the bf16
    outputs and the committed states bit for bit."""
    (N, T), device = case["x"].shape[:2], case["x"].device
    block, single = _gdn_state(case, "replay", **state_kw), _gdn_state(case, "replay", **state_kw)
    block.reserve(T)
    single.reserve(1)
    o_block = block.verify(0, *_inputs(case))
    block.commit(torch.full((N,), T, device=device))
    block.flush()
    o_steps = []
    for t in range(T):
        o_steps.append(single.verify(0, *_inputs(case, t)))
        single.commit(torch.ones(N, dtype=torch.long, device=device))
    single.flush()
    assert o_block.dtype == torch.bfloat16
    assert torch.equal(o_block, torch.cat(o_steps, dim=1))
    assert torch.equal(block.rec, single.rec) and torch.equal(block.conv, single.conv)


@pytest.mark.parametrize("device", DEVICES)
def test_reserved_logs_keep_their_addresses(device):
    """After reserve(T), every mode's T-token verify writes its log into the reserved tensors (what
    captured verify and commit graphs share) and the commit through use_static(T) is unchanged."""
    T, N = 3, 2
    case = make_case(N, T, device=device, seed=50)
    n = torch.tensor([1, T], device=device)
    for mode in ("reference", "replay", "native"):
        plain, fixed = _gdn_state(case, mode), _gdn_state(case, mode)
        fixed.reserve(T)
        reserved = fixed._static[T][0]
        ptrs = [t.data_ptr() for t in vars(reserved).values() if t is not None]
        o_plain = plain.verify(0, *_inputs(case))
        o_fixed = fixed.verify(0, *_inputs(case))
        assert [t.data_ptr() for t in vars(fixed.logs[0]).values() if t is not None] == ptrs, mode
        assert reserved.native == (mode == "native")
        fixed.logs = [None]  # as a graph replay leaves them: the commit must find the reserved ones
        fixed.use_static(T)
        plain.commit(n)
        fixed.commit(n)
        # replay mode defers the commit of reserved logs into the next verify: the states are read
        # here, right after the commit, so they are materialised first (a no-op in the other modes)
        fixed.flush()
        assert torch.equal(o_plain, o_fixed) and torch.equal(plain.rec, fixed.rec), mode
        assert torch.equal(plain.conv, fixed.conv), mode


def _steps(N, T, heads, layers, steps, device, seed):
    """Per step, per layer: GDNState.verify's arguments after the slot. x, a, b are new every step;
    each layer's conv weight, A_log and dt_bias stay (a model's weights)."""
    weights = [make_case(1, 1, heads, device=device, seed=seed + i) for i in range(layers)]
    out = []
    for step in range(steps):
        c = make_case(N, T, heads, device=device, seed=seed + 100 + step)
        out.append([(c["x"], w["conv_weight"], c["a"], c["b"], w["A_log"], w["dt_bias"]) for w in weights])
    return out


def _same_states(a: GDNState, b: GDNState) -> bool:
    return torch.equal(a.rec, b.rec) and torch.equal(a.conv, b.conv)


@pytest.mark.parametrize(
    "device, T, heads, tiles",
    per_device(
        cpu=[
            (1, GQA_CPU, {}),  # AR decode: n is 0 or 1
            # 2 value slices per head; chunks of 2 (raised to K-1 by the fold)
            (5, GQA_CPU, dict(block_v=4, block_t=2)),
            (9, (2, 2, 9, 5), {}),  # one key head per value head
        ],
        cuda=[(1, GQA, {}), (5, GQA, dict(block_v=4, block_t=2)), (9, (3, 3, 9, 5), {})],
    ),
)
def test_deferred_commit_equals_eager_fold(device, T, heads, tiles):
    """ReplaySSM with reserved logs defers each commit's fold into the next verify, which folds the pending
    n into the state tile in its registers (the commit itself, one launch for all layers, rolls the conv
    windows and stashes the pending k / g). Against the eager path (no reserved logs: the commit kernel
    folds at once), over verify / commit steps of two layers with ragged n, every row committing 0 once
    and T once: every verify's outputs and logs bit for bit; the windows bit for bit right after each
    commit; the recurrent states bit for bit once a verify has folded, and untouched by the deferred
    commit itself (the fold really moved); after the last commit, flush() gives bit for bit the eager
    states."""
    # n per step and row; rows 0-2 already commit 0, 1, T and T // 2, each 0 once and T once: the
    # interpreter (CPU), whose time is per row, runs those three (a quarter less), the GPU all four
    schedule = [[0, 1, T, T // 2], [T, 0, 1, T], [T // 2, T, 0, 0]]
    N, L = (4 if device == "cuda" else 3), 2
    start = make_case(N, T, heads, device=device, seed=60 + T)
    eager = _gdn_state(start, "replay", L, kernel_options=tiles)
    lazy = _gdn_state(start, "replay", L, kernel_options=tiles)
    lazy.reserve(T)
    for args, n in zip(_steps(N, T, heads, L, len(schedule), device, seed=T), [row[:N] for row in schedule]):
        for layer in range(L):
            assert torch.equal(eager.verify(layer, *args[layer]), lazy.verify(layer, *args[layer]))
            for name in ("x", "k", "u", "g"):
                assert torch.equal(getattr(eager.logs[layer], name), getattr(lazy.logs[layer], name)), name
        assert _same_states(eager, lazy)  # each layer's verify materialised the previous commit
        n = torch.tensor(n, device=device)
        rec, conv = lazy.rec.clone(), lazy.conv.clone()
        eager.commit(n)
        lazy.commit(n)
        # deferred: the windows are rolled (and equal the eager commit's), the states not folded yet
        assert torch.equal(lazy.rec, rec) and torch.equal(lazy.conv, eager.conv)
        assert not torch.equal(lazy.rec, eager.rec) and not torch.equal(conv, eager.conv)
    lazy.flush()
    assert _same_states(eager, lazy)


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_commit_across_block_lengths(device):
    """The engine reserves T = 1 (AR) and T = B (blocks); a prefill has its own length. A fold pending in
    the logs of one length is flushed by a verify of another (which can only fold its own log), an
    unreserved verify flushes too, and a verify repeated without a commit folds nothing the second time
    (each program zeroes its count): all bit for bit the eager path's outputs and states."""
    N, B = 3, 4
    start = make_case(N, B, device=device, seed=80)
    eager, lazy = _gdn_state(start, "replay"), _gdn_state(start, "replay")
    lazy.reserve(1)
    lazy.reserve(B)
    # (T, n per row, verifies before the commit)
    plan = [(B, [0, 2, B], 1), (1, [1, 0, 1], 1), (B, [B, 1, 3], 2), (3, [2, 3, 0], 1), (B, [1, B, 0], 1)]
    for i, (T, n, repeat) in enumerate(plan):
        args = _steps(N, T, GQA, 1, 1, device, seed=90 + i)[0][0]
        o_eager = eager.verify(0, *args)
        for _ in range(repeat):
            assert torch.equal(lazy.verify(0, *args), o_eager), (i, T)
            assert _same_states(eager, lazy), (i, T)
        n = torch.tensor(n, device=device)
        eager.commit(n)
        lazy.commit(n)
        assert lazy._deferred == (T if T in (1, B) else None), i  # reserved lengths defer, the prefill does not
    lazy.flush()
    assert _same_states(eager, lazy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("native", [False, True], ids=["replayssm", "native"])
def test_bf16_inputs_fp32_state(device, native):
    """bf16 projections / conv window / outputs with the fp32 state, as a bf16 model runs.

    The kernel rounds where the twin rounds (conv output, SiLU, β to bf16; o at the end), but the
    fp32 sums inside differ in order, so a bf16 rounding step can flip by one ulp (2^-8 relative)
    and move what follows: outputs within a few bf16 ulps, logs and states within bf16-level error.
    """
    T, N = 8, 3
    case = make_case(N, T, dtype=torch.bfloat16, device=device, seed=40)
    o, log = gdn_verify_triton(**case, native=native)
    o_ref, log_ref = gdn_verify_reference(**case, native=native)
    assert o.dtype == torch.bfloat16 and log.x.dtype == torch.bfloat16
    bf16 = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o, o_ref, **bf16)
    for name in ("states",) if native else ("k", "u", "g"):
        assert getattr(log, name).dtype == torch.float32
        torch.testing.assert_close(getattr(log, name), getattr(log_ref, name), **bf16, msg=name)
    n = _ragged_n(N, T).to(device)
    conv, rec = case["conv_state"].clone(), case["rec_state"].clone()
    gdn_replay_triton(conv, rec, log, n)
    conv_ref, rec_ref = gdn_replay(case["conv_state"], case["rec_state"], log, n)  # same log: tight
    torch.testing.assert_close(rec, rec_ref, **F32)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)


def test_cpu_without_the_interpreter_names_the_fix():
    """In a process that imported triton without TRITON_INTERPRET, a Triton mode on CPU tensors fails
    with the fix in the message (instead of Triton's own error about pointers)."""
    import subprocess
    import sys

    from conftest import subprocess_env

    code = (
        "import torch\n"
        "from test_runtime_gdn_kernels import make_case\n"
        "from dflash2.runtime.kernels.gdn_verify import gdn_verify_triton\n"
        "try:\n"
        "    gdn_verify_triton(**make_case(1, 2))\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in subprocess_env().items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "TRITON_INTERPRET=1" in out.stdout, out.stderr[-2000:]
