"""The GDN recurrence's ``fma`` option: its d_k sums and its state update as fused multiply-adds
(dflash2/runtime/kernels/gdn_verify/kernel.py: ``_dot_rows``, ``_fma_pair``, ``_fold_token``).

* The sums' combine is commutative bit for bit in all four cases (two products, a partial sum and a product
  either way round, two partial sums): in a warp's butterfly two lanes combine the same pair in opposite order
  and must keep the same sum.
* The other GDN suites run the default setting: fma on a GPU, off under Triton's interpreter
  (gdn_log.default_fma: the interpreter runs the fma sums slowly). Here the same invariants with the *other*
  setting (``OTHER``: on in the CPU cases, off in the GPU ones): verify(T) + commit(n) == n single-token steps
  bit for bit (u, states, conv), native == ReplaySSM, the eager commit and the deferred fold alike, for ragged
  n with 0 and T; bf16 block verify + deferred commit == single-token decoding bit for bit (also through the
  one-launch kernel).
* With fma on, the hand-prefetch loop (stages 0) == the pipelined one (stages 3) through the deferred fold.
* On against off, and each against the plain-PyTorch twin: equal to fp32 rounding; the conv windows exactly.

The CPU cases run in Triton's interpreter. Only on a GPU do the fma sums really run as per-lane chains and
butterflies, which is where a combine that is not symmetric breaks the exact fold (stop 23). There, fma on
is checked by the other suites' exact-fold and bf16 tests (fma is their default on a GPU, and their tiles
include d_k 5, one element per lane) and here by the commutativity case and the deferred-fold case (d_k 5, 64)."""

import pytest
import torch
import triton
import triton.language as tl
from test_runtime_gdn_kernels import (
    DEVICES,
    F32,
    GQA,
    GQA_CPU,
    _after,
    _decode,
    _gdn_state,
    _inputs,
    _steps,
    assert_block_verify_equals_single_token_decoding,
    make_case,
    per_device,
)

from dflash2.runtime.kernels.gdn_log import default_fma
from dflash2.runtime.kernels.gdn_verify.kernel import _fma_pair

OTHER_FMA = not default_fma(None)  # the setting the other suites do not run here
OTHER = dict(kernel_options=dict(fma=OTHER_FMA))
WIDE = (2, 4, 64, 32)  # Hk, H, d_k, d_v: several d_k rows per lane


@triton.jit
def _both_orders(ax, ay, ap, bx, by, bp, ab, ba, BN: tl.constexpr):
    """_fma_pair(a, b) into ab and _fma_pair(b, a) into ba, elementwise over BN pairs."""
    o = tl.arange(0, BN)
    a_x, a_y, a_p = tl.load(ax + o), tl.load(ay + o), tl.load(ap + o)
    b_x, b_y, b_p = tl.load(bx + o), tl.load(by + o), tl.load(bp + o)
    s, one, tag = _fma_pair(a_x, a_y, a_p, b_x, b_y, b_p)
    r, _, _ = _fma_pair(b_x, b_y, b_p, a_x, a_y, a_p)
    tl.store(ab + o, s * one * tag)  # one and tag are 1 (a partial sum): the stored value is s
    tl.store(ba + o, r)


@pytest.mark.parametrize("device", DEVICES)
def test_fma_combine_is_commutative_bit_for_bit(device):
    g = torch.Generator().manual_seed(7)
    n = 1024
    ax, ay, bx, by = (torch.randn(n, generator=g) for _ in range(4))
    # the four cases by quarters: product / product, partial sum / product, product / partial sum, sums
    ap, bp = torch.zeros(n), torch.zeros(n)
    ap[n // 4 : n // 2] = ap[3 * n // 4 :] = 1.0
    bp[n // 2 :] = 1.0
    ay[ap == 1], by[bp == 1] = 1.0, 1.0  # a partial sum carries y = 1
    ay[: n // 8] = 1.0  # products whose y happens to be 1 stay products
    ax, ay, ap, bx, by, bp = (t.to(device) for t in (ax, ay, ap, bx, by, bp))
    ab, ba = torch.empty(n, device=device), torch.empty(n, device=device)
    _both_orders[(1,)](ax, ay, ap, bx, by, bp, ab, ba, BN=n)
    assert torch.equal(ab, ba)
    exact = ax.double() * ay.double() + bx.double() * by.double()
    # at most three fp32 roundings (two products, one sum), each within 2⁻²⁴ of the magnitudes involved
    bound = 2.0**-24 * (2 * (ax.double() * ay.double()).abs() + 2 * (bx.double() * by.double()).abs())
    assert bool(((ab.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize(
    "device, T, heads",
    per_device(cpu=[(3, GQA_CPU)], cuda=[(3, GQA), (9, GQA), (16, GQA), (16, WIDE)]),
)
def test_other_fma_exact_fold_equals_single_token_decoding(device, T, heads):
    """test_runtime_gdn_kernels.py's exact-fold test with the other fma setting (the decoding as well)."""
    N = 4
    case = make_case(N, T, heads, device=device, seed=20 + T)
    n = torch.tensor([0, 1, T // 2, T], device=device)
    conv_steps, rec_steps, u_steps = _decode(case, "replay", **OTHER)
    for mode in ("replay", "native"):
        s = _gdn_state(case, mode, **OTHER)
        s.verify(0, *_inputs(case))
        if mode == "replay":
            assert torch.equal(s.logs[0].u, u_steps)
        s.commit(n)
        assert torch.equal(s.rec[0], _after(rec_steps, n)), mode
        assert torch.equal(s.conv[0], _after(conv_steps, n)), mode


@pytest.mark.parametrize(
    "device, heads, T, N, one_launch",
    per_device(
        cpu=[(GQA_CPU, 3, 2, False), (GQA_CPU, 3, 2, True)],
        cuda=[(GQA, 16, 4, False), (WIDE, 16, 4, False), (WIDE, 5, 3, False), (GQA, 16, 4, True)],
    ),
)
def test_other_fma_bf16_block_verify_equals_single_token_decoding(device, heads, T, N, one_launch):
    """Reserved logs, deferred commit: the recurrence kernel, or the one-launch kernel (one_launch.py)."""
    case = make_case(N, T, heads, dtype=torch.bfloat16, device=device, seed=31)
    assert_block_verify_equals_single_token_decoding(case, kernel_options=dict(fma=OTHER_FMA, one_launch=one_launch))


# GPU only: the interpreter runs both loops' arithmetic alike by construction (the deferred fold with fma is
# interpreted in the bf16 decoding test above), and three states over three steps took ~12 s there
@pytest.mark.parametrize("device, heads", per_device(cpu=[], cuda=[(GQA,), (WIDE,)]))
def test_fma_deferred_fold_hand_prefetch_equals_pipelined(device, heads):
    """Reserved logs, ragged n over three steps: stages 0 and 3 with fma on give the same outputs and
    states bit for bit, and stay within fp32 rounding of fma off."""
    N, T, L = 3, 4, 1
    start = make_case(N, T, heads, device=device, seed=80)
    options = {"s0": dict(stages=0, fma=True), "s3": dict(stages=3, fma=True), "off": dict(stages=3, fma=False)}
    states = {k: _gdn_state(start, "replay", L, kernel_options=o) for k, o in options.items()}
    for s in states.values():
        s.reserve(T)
    schedule = [[0, 1, T], [T, 0, 2], [2, T, 1]]
    for args, n in zip(_steps(N, T, heads, L, len(schedule), device, seed=81), schedule):
        o = {k: s.verify(0, *args[0]) for k, s in states.items()}
        assert torch.equal(o["s0"], o["s3"])
        torch.testing.assert_close(o["s3"], o["off"], **F32)
        for s in states.values():
            s.commit(torch.tensor(n, device=device))
    for s in states.values():
        s.flush()
    assert torch.equal(states["s0"].rec, states["s3"].rec) and torch.equal(states["s0"].conv, states["s3"].conv)
    torch.testing.assert_close(states["s3"].rec, states["off"].rec, **F32)
    assert torch.equal(states["s3"].conv, states["off"].conv)


@pytest.mark.parametrize("device, heads", per_device(cpu=[(GQA_CPU,)], cuda=[(GQA,), (WIDE,)]))
def test_fma_on_and_off_match_the_reference_decoding(device, heads):
    """Single-token decoding with fma on and off against the plain-PyTorch twin's: fp32 rounding apart."""
    T = 4
    case = make_case(2, T, heads, device=device, seed=44)
    conv_ref, rec_ref, _ = _decode(case, "reference")
    for options in (dict(kernel_options=dict(fma=True)), dict(kernel_options=dict(fma=False))):
        conv, rec, _ = _decode(case, "replay", **options)
        torch.testing.assert_close(rec, rec_ref, **F32)
        torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
