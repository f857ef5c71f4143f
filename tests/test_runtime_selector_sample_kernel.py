"""The selector's T>0 walk in one launch (dflash2/runtime/kernels/selector_sample.py).

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


def _walk_inputs(dtype, device, seed=4):
    g = torch.Generator().manual_seed(seed)
    pcb, scb = (torch.randn(V, R, generator=g).to(device, dtype) for _ in range(2))
    hh = torch.randn(N, P, R, generator=g).to(device, dtype)
    cand_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N * P)]).view(N, P, K).to(device)
    unary = torch.randn(N, P, K, generator=g).to(device)
    anchor = torch.tensor([0, 7, 39], device=device)
    races = torch.empty(P, N, K).exponential_(1, generator=g).to(device)
    return hh, cand_ids, unary, anchor, pcb, scb, T, races


def _drawn_from(tokens, cand_ids, probs, races):
    """Whether each token is argmax(probs / race) of its position (the exponential race's draw from probs)."""
    choice = (probs / races.transpose(0, 1)).argmax(-1, keepdim=True)  # (N, P, 1)
    return torch.equal(tokens, cand_ids.gather(-1, choice)[..., 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_twin(interpret, dtype):
    devices = kernel_devices()
    if not devices:
        pytest.skip("needs Triton's interpreter or a GPU")
    for device in devices:
        args = _walk_inputs(dtype, device)
        tokens, probs = selector_sample_walk(*args)
        want_tokens, want_probs = selector_sample_walk_ref(*args)
        assert tokens.dtype == torch.long and probs.shape == (N, P, K) and probs.dtype == torch.float32
        assert torch.equal(tokens, want_tokens)
        # bf16: the interpreter truncates where torch rounds, so a pair term may be one bf16 step off
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(probs, want_probs, rtol=tol, atol=tol)
        assert _drawn_from(tokens, args[1], probs, args[-1])
        torch.testing.assert_close(probs.sum(-1), torch.ones(N, P, device=device))
        # the pipeline depth moves loads, not arithmetic (meaningful on a GPU: the interpreter ignores num_stages)
        unpiped = selector_sample_walk(*args, stages=1)
        assert torch.equal(unpiped[0], tokens) and torch.equal(unpiped[1], probs)


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
    assert launches == [1]  # the walk ran as the kernel, once
