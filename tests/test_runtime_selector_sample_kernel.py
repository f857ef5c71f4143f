"""The selector's T>0 walk in two launches: the pair tables, the walk (dflash2/runtime/kernels/selector_sample.py).

* the twin is ``selector_sample_sparse``'s eager walk bit for bit (given its per-position hidden projections
  and the same races), so it is ``CandidateSelector.sample_path`` (tests/test_runtime_sampling.py);
* the kernel == the twin: the same tokens on these seeds (a near-tie of prob / race could go either way),
  probs to rounding, and every token is exactly the race's draw from the kernel's own probs (its q is the
  law its drafts were drawn from, so the verify stays lossless);
* ``selector_sample_sparse`` through the kernels draws what the eager path draws and advances the
  generator alike.
"""

import pytest
import torch
from kernel_devices import kernel_devices

from dflash2.drafter.selector import CandidateSelector
from dflash2.runtime import kernels
from dflash2.runtime.kernels.selector_sample import selector_sample_walk, selector_sample_walk_ref
from dflash2.runtime.selector_path import block_candidates, selector_sample_sparse

N, P, K, V, R = 3, 6, 5, 40, 24  # odd sizes: k and r no powers of two
T = 0.7


# (N, P, k, V, r) of the kernel tests: odd sizes (the module's), the real drafter's (P 15, k 16, r 256), one position,
# k above one 16-wide tile and r not a multiple of 16
SIZES = [(N, P, K, V, R), (1, 15, 16, 300, 256), (3, 15, 16, 300, 256), (3, 1, K, V, R), (2, 7, 19, 64, 100)]


def _walk_inputs(dtype, device, seed=4, sizes=(N, P, K, V, R)):
    n, p, k, v, r = sizes
    g = torch.Generator().manual_seed(seed)
    pcb, scb = (torch.randn(v, r, generator=g).to(device, dtype) for _ in range(2))
    hh = (torch.randn(n, p, r, generator=g) * (R / r) ** 0.5).to(device, dtype)  # pair terms spread as at rank R
    cand_ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n * p)]).view(n, p, k).to(device)
    unary = torch.randn(n, p, k, generator=g).to(device)
    anchor = torch.tensor([0, 7, 39], device=device) if n == 3 else torch.randint(0, v, (n,), generator=g).to(device)
    races = torch.empty(p, n, k).exponential_(1, generator=g).to(device)
    return hh, cand_ids, unary, anchor, pcb, scb, T, races


def _drawn_from(tokens, cand_ids, probs, races):
    """Whether each token is argmax(probs / race) of its position (the exponential race's draw from probs)."""
    choice = (probs / races.transpose(0, 1)).argmax(-1, keepdim=True)  # (N, P, 1)
    return torch.equal(tokens, cand_ids.gather(-1, choice)[..., 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", SIZES)
def test_kernel_equals_twin(interpret, dtype, sizes):
    devices = kernel_devices()
    if not devices:
        pytest.skip("needs Triton's interpreter or a GPU")
    n, p, k = sizes[:3]
    for device in devices:
        args = _walk_inputs(dtype, device, sizes=sizes)
        tokens, probs = selector_sample_walk(*args)
        want_tokens, want_probs = selector_sample_walk_ref(*args)
        assert tokens.dtype == torch.long and probs.shape == (n, p, k) and probs.dtype == torch.float32
        assert torch.equal(tokens, want_tokens)
        # bf16: the interpreter truncates where torch rounds, so a pair term may be one bf16 step off
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(probs, want_probs, rtol=tol, atol=tol)
        assert _drawn_from(tokens, args[1], probs, args[-1])
        torch.testing.assert_close(probs.sum(-1), torch.ones(n, p, device=device))


def test_twin_is_the_eager_sparse_path():
    """Given selector_sample_sparse's per-position hidden projections and its races, the twin is its walk."""
    torch.manual_seed(0)
    sel = CandidateSelector(vocab=50, hidden=16, rank=8, top_k=5, init_std=0.5)
    hidden, logits, anchor = torch.randn(4, 7, 16), torch.randn(4, 7, 50), torch.randint(0, 50, (4,))
    want = selector_sample_sparse(sel, hidden, logits, anchor, T, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    races = torch.stack([torch.empty(4, 5).exponential_(1, generator=g) for _ in range(7)])
    with torch.no_grad():
        hh = torch.cat([sel.hidden_projection(hidden[:, p : p + 1]) for p in range(7)], 1)
        cand_ids, unary = block_candidates(sel, logits)
        pcb, scb = sel.predecessor_codebook, sel.successor_codebook
        tokens, probs = selector_sample_walk_ref(hh, cand_ids, unary, anchor, pcb, scb, T, races)
    assert torch.equal(tokens, want.tokens) and torch.equal(cand_ids, want.ids) and torch.equal(probs, want.probs)


def test_sparse_path_through_the_kernels(interpret, monkeypatch):
    """selector_sample_sparse with the kernels (top-k, the walk) == the eager path: the same tokens and
    candidates, probs to rounding, and the generator left in the same state (the same draws were made)."""
    if "cpu" not in kernel_devices():
        pytest.skip("runs the kernels through the interpreter")
    import dflash2.runtime.kernels.selector_sample as mod

    launches, jit = [], mod.jit
    monkeypatch.setattr(mod, "jit", lambda *a, **k: launches.append(1) or jit(*a, **k))
    torch.manual_seed(0)
    sel = CandidateSelector(vocab=50, hidden=16, rank=8, top_k=5, init_std=0.5)
    hidden, logits, anchor = torch.randn(4, 7, 16), torch.randn(4, 7, 50), torch.randint(0, 50, (4,))
    g_eager, g_fused = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    with kernels.kernels(False):
        want = selector_sample_sparse(sel, hidden, logits, anchor, T, g_eager)
    got = selector_sample_sparse(sel, hidden, logits, anchor, T, g_fused)  # the interpret fixture: kernels
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(g_eager.get_state(), g_fused.get_state())
    assert launches == [1]  # the walk ran as the kernel, once (its pair tables: kernels/selector.py's jit)
