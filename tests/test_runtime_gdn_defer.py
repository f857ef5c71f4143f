"""ReplaySSM's deferred commit kernel (kernels/gdn_replay/defer_kernel.py) against its twin.

The kernel does a commit's work except the fold, for every GDN layer in one launch: the pending
counts, the conv windows rolled by n, the accepted tokens' k / g copied to the stash. All copies,
so the kernel must equal the twin exactly: odd channel counts and head dims (tile padding),
GQA-style and equal heads, a conv kernel of 2 and 4, T = 1 and T = 9, ragged n with 0 and T
present; stash rows past a row's n must keep what they held (the next fold never reads them, and
the commit must not move bytes it need not). Interpreted on the CPU, compiled on the GPU.
"""

import pytest
import torch
from test_runtime_gdn_kernels import DEVICES

from dflash2.runtime.kernels.gdn_replay import gdn_defer_commit_triton
from dflash2.runtime.kernels.gdn_replay.reference import gdn_defer_commit, roll_window


def _case(L, N, T, heads, K, P, dtype, device, seed):
    hk, h, dk, dv = heads
    C = 2 * hk * dk + h * dv
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    n = torch.randint(0, T + 1, (N,), generator=gen)
    n[0], n[-1] = 0, T
    return dict(
        n=n.to(device),
        pend=torch.full((L, N, P), -7, dtype=torch.int32, device=device),
        conv=rnd(L, N, C, K - 1, dt=dtype),
        x=rnd(L, N, T, C, dt=dtype),
        k=rnd(L, N, T, hk, dk),
        g=rnd(L, N, T, h),
        stash_k=rnd(L, N, T, hk, dk),  # stale values from an earlier step
        stash_g=rnd(L, N, T, h),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "T, heads, K, dtype, P",  # P: counts per row (any width; two cases not a multiple of Hk: ragged tiles)
    [
        (9, (2, 4, 5, 7), 4, torch.float32, 7),  # GQA, odd dims, the Qwen3.5 conv kernel
        (1, (3, 3, 3, 6), 2, torch.bfloat16, 10),  # AR's one token, equal heads, a one-column window
        (9, (1, 2, 9, 3), 4, torch.bfloat16, 6),
    ],
)
def test_deferred_commit_kernel_equals_twin(device, T, heads, K, dtype, P):
    L, N = 3, 4
    case = _case(L, N, T, heads, K, P, dtype, device, seed=T + K)
    want = {name: t.clone() for name, t in case.items()}
    gdn_defer_commit_triton(**case)
    gdn_defer_commit(**want)
    for name in ("pend", "conv", "stash_k", "stash_g"):
        assert torch.equal(case[name], want[name]), name
    n = case["n"].cpu()
    assert torch.equal(case["pend"].cpu(), n.view(1, -1, 1).expand(L, N, P).to(torch.int32))
    # the twin itself: windows rolled by n (row 0 with n = 0 unchanged), stash = log below n, untouched above
    start = _case(L, N, T, heads, K, P, dtype, device, seed=T + K)
    for layer in range(L):
        assert torch.equal(case["conv"][layer], roll_window(start["conv"][layer], start["x"][layer], case["n"]))
    assert torch.equal(case["conv"][:, 0], start["conv"][:, 0])
    for r in range(N):
        m = int(n[r])
        assert torch.equal(case["stash_k"][:, r, :m], start["k"][:, r, :m])
        assert torch.equal(case["stash_k"][:, r, m:], start["stash_k"][:, r, m:])
        assert torch.equal(case["stash_g"][:, r, :m], start["g"][:, r, :m])
        assert torch.equal(case["stash_g"][:, r, m:], start["stash_g"][:, r, m:])


def test_deferred_commit_refuses_what_the_kernel_would_misaddress():
    """Checked before any launch (the kernel addresses the stash with the log's strides and n as a
    contiguous vector): wrong shapes, a stash strided unlike the log, a strided n; no rows: nothing."""

    def case():
        return _case(2, 2, 3, (1, 2, 3, 3), 4, 4, torch.float32, "cpu", seed=0)

    bad = case()
    bad["stash_g"] = bad["stash_g"][:, :, :2]
    with pytest.raises(ValueError, match="shapes"):
        gdn_defer_commit_triton(**bad)
    bad = case()
    bad["stash_k"] = torch.zeros(2, 2, 5, 1, 3)[:, :, :3]  # rows contiguous, (layer, row) strides not the log's
    with pytest.raises(ValueError, match="strides"):
        gdn_defer_commit_triton(**bad)
    bad = case()
    bad["n"] = torch.tensor([[1, 0], [2, 0]])[:, 0]
    with pytest.raises(ValueError, match="contiguous vector"):
        gdn_defer_commit_triton(**bad)
    empty = {name: t[:, :0] if t.dim() > 1 else t[:0] for name, t in case().items()}
    gdn_defer_commit_triton(**empty)  # N = 0: returns without a launch
