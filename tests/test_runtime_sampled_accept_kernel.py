"""The T>0 accept in two launches (dflash2/runtime/kernels/sampled_accept.py): kernel == twin, twin ~ the old path.

* kernel == twin exactly (the whole slot buffers: tokens, counts, flags, commits, the log), on random
  rows: batch 1 and ragged batches, P = 0 / 3 / 7 / 15, point masses, k-sparse and dense q, EOS inside
  the block, budget cuts, inactive rows, a vocabulary that is no multiple of the chunk, rows whose
  residual is zero (the fallback draw from p_a) and rows that accept every draft; many chunks, with
  maxima in late chunks and exact ties across chunks (the first index wins), also in the fallback;
* twin == the unfused path (``step.accept_sampled`` + the engine's bookkeeping before the fusion) for one
  generator state: the same accepted counts everywhere, and the same bonus tokens, emissions, commits
  and flags in every row whose bonus draw is not a near-tie (the twin leaves the residual unnormalised,
  which may flip an argmax between scores a few ulps apart: see the kernel's docstring);
* the law: the first emitted token follows p_0 and a correction follows the normalised residual
  (chi-square), through the twin and through the kernel;
* whole T>0 generations through the kernel == through the twin.
"""

import os

import pytest
import torch
from conftest import chi2_pvalue, nontrivial_dflash2, spec_drafter
from kernel_devices import kernel_devices

from dflash2.runtime import kernels
from dflash2.runtime.kernels.sampled_accept import sampled_accept, sampled_accept_ref
from dflash2.runtime.sampling import Proposal, accept_noise, accepted_prefix, residual, with_q
from dflash2.runtime.step import accept_sampled, emit

V = 40  # small: EOS ids and full accepts are frequent; no multiple of the chunk the tests pick
BLOCK_V = 16
E_SLOTS = 4
NAMES = ("eos", "active", "count", "limit", "out", "commit_n", "token")
PASS = 1e-3


def _proposal(N, P, q, g):
    """Drafts (N, P) drawn from a random q of kind q: 'point' (k = 1), 'sparse' (k = 5 distinct ids), 'dense'."""
    if q == "dense":
        dense = torch.softmax(2 * torch.randn(N, P, V, generator=g), -1)
        drafts = torch.multinomial(dense.view(-1, V), 1, generator=g).view(N, P) if P else torch.zeros(N, 0).long()
        return Proposal(drafts, dense=dense)
    k = 1 if q == "point" else 5
    ids = torch.rand(N, P, V, generator=g).argsort(-1)[..., :k].contiguous()
    probs = torch.softmax(torch.randn(N, P, k, generator=g), -1)
    pick = torch.multinomial(probs.view(-1, k), 1, generator=g).view(N, P, 1) if P else ids[..., :1]
    return Proposal(ids.gather(-1, pick)[..., 0].contiguous(), ids, probs)


def _inputs(N, P, q, seed):
    """p (N, P+1, V), a proposal, and the slot's buffers of ragged rows (out / log poisoned with -5).

    p is half a random law and half q, so drafts are often accepted; some rows take p = q (every draft
    accepted) and some p = q / 2 (rejections with a zero residual: the fallback draw from p_a)."""
    g = torch.Generator().manual_seed(seed)
    proposal = _proposal(N, P, q, g)
    p = torch.softmax(2 * torch.randn(N, P + 1, V, generator=g), -1)
    if P:
        qd = with_q(proposal).densify(V)
        p[:, :P] = 0.5 * p[:, :P] + 0.5 * qd
        how = torch.randint(0, 5, (N,), generator=g)
        p[how == 0, :P] = qd[how == 0]
        p[how == 1, :P] = 0.5 * qd[how == 1]
    drafted = proposal.tokens.flatten()
    eos = drafted[torch.randint(0, max(drafted.numel(), 1), (2,), generator=g)].tolist() if P else [3]
    count = torch.randint(0, 20, (N,), generator=g)
    limit = count + torch.randint(0, P + 3, (N,), generator=g)
    active = (torch.rand(N, generator=g) < 0.85) & (limit > count)  # the engine's invariant
    z = dict(dtype=torch.long)
    buf = dict(
        eos=torch.tensor((eos + [-1] * E_SLOTS)[:E_SLOTS]),
        active=active,
        count=count,
        limit=limit,
        out=torch.full((N, int(count.max()) + P + 4), -5, **z),
        commit_n=torch.full((N,), -5, **z),
        token=torch.arange(100, 100 + N),
        log=torch.full((4, 3, N), -5, **z),
        step=torch.tensor([2]),
    )
    return p, proposal, buf


def _to(x, device):
    if isinstance(x, Proposal):
        return Proposal(*(None if t is None else t.to(device) for t in (x.tokens, x.ids, x.probs, x.dense)))
    if isinstance(x, dict):
        return {k: v.to(device) for k, v in x.items()}
    return x.to(device)


def _run(fn, p, proposal, u, race, buf, **kw):
    b = {k: v.clone() for k, v in buf.items()}
    fn(p, proposal, u, race, *(b[k] for k in NAMES), log=b["log"], step=b["step"], **kw)
    return b


def _old_engine(p, proposal, seed, buf):
    """The engine's T>0 accept before the fusion: ``accept_sampled`` (drawing from a generator of ``seed``)
    then its in-place bookkeeping."""
    b = {k: v.clone() for k, v in buf.items()}
    finish = dict(active=b["active"], eos_token_id=b["eos"], budget=b["limit"] - b["count"])
    acc = accept_sampled(p, proposal, torch.Generator().manual_seed(seed), **finish)
    b["commit_n"].copy_(torch.where(acc.finished, 0, acc.commit))
    b["count"].copy_(emit(b["out"], b["count"], acc.tokens, acc.num_emitted))
    b["log"].index_copy_(0, b["step"], torch.stack([b["active"].long(), acc.num_accepted, acc.num_emitted])[None])
    b["active"].copy_(b["active"] & ~acc.finished)
    b["token"].copy_(torch.where(b["active"], acc.next_anchor, b["token"]))
    return b


# ------------------------------------------------------------------ kernel == twin
CASES = [(N, P, q) for P in (0, 3, 7, 15) for q in ("point", "sparse", "dense") for N in (1, 9)]


def _fresh_rows(N: int, *, limit: int, out: torch.Tensor) -> dict:
    """Slot buffers of N active rows at the start of a generation (count 0, no EOS, one log step), with the
    given budget and output row: the bookkeeping arguments of sampled_accept / its twin."""
    z = dict(dtype=torch.long)
    return dict(
        eos=torch.tensor([-1, -1]),
        active=torch.ones(N, dtype=torch.bool),
        count=torch.zeros(N, **z),
        limit=torch.full((N,), limit),
        out=out,
        commit_n=torch.zeros(N, **z),
        token=torch.zeros(N, **z),
        log=torch.zeros(1, 3, N, **z),
        step=torch.tensor([0]),
    )


@pytest.mark.parametrize("N,P,q", CASES)
def test_kernel_equals_twin(interpret, monkeypatch, N, P, q):
    devices = kernel_devices()
    if not devices:
        pytest.skip("needs Triton's interpreter or a GPU")
    import dflash2.runtime.kernels.sampled_accept as mod

    launches, jit = [], mod.jit
    monkeypatch.setattr(mod, "jit", lambda *a, **k: launches.append(1) or jit(*a, **k))
    for seed in range(2):
        p, proposal, buf = _inputs(N, P, q, seed=100 * P + seed)
        u, race = accept_noise(p, P, torch.Generator().manual_seed(seed))
        twin = _run(sampled_accept_ref, p, proposal, u, race, buf)
        for device in devices:
            args = [_to(x, device) for x in (p, proposal, u, race, buf)]
            for block_v in (BLOCK_V, None):  # 3 chunks, the last one partial; one partial chunk
                got = _run(sampled_accept, *args, block_v=block_v)
                for k in twin:
                    assert torch.equal(got[k].cpu(), twin[k]), (device, block_v, k)
    assert len(launches) == 2 * 4 * len(devices)  # the kernels ran (the inputs fit them): chunks, then the finish


def test_kernel_equals_twin_over_default_chunks(interpret):
    """A vocabulary of 2500: three chunks of the default 1024, the last partial, p in bf16."""
    g = torch.Generator().manual_seed(0)
    N, P, Vb = 3, 7, 2500
    p = torch.softmax(3 * torch.randn(N, P + 1, Vb, generator=g), -1).bfloat16()
    ids = torch.rand(N, P, Vb, generator=g).argsort(-1)[..., :4].contiguous()
    ids[..., 0] = p[:, :P].float().argmax(-1)  # drafts the target likes, so some are accepted
    ids[..., 1:] = torch.where(ids[..., 1:] == ids[..., :1], (ids[..., :1] + 1) % Vb, ids[..., 1:])
    proposal = Proposal(ids[..., 0].contiguous(), ids, torch.softmax(torch.randn(N, P, 4, generator=g), -1))
    z = dict(dtype=torch.long)
    buf = dict(
        eos=torch.tensor([int(ids[1, 2, 0]), -1]),
        active=torch.tensor([True, True, False]),
        count=torch.tensor([0, 5, 3]),
        limit=torch.tensor([4, 50, 3]),
        out=torch.full((N, 16), -5, **z),
        commit_n=torch.zeros(N, **z),
        token=torch.zeros(N, **z),
        log=torch.zeros(3, 3, N, **z),
        step=torch.tensor([0]),
    )
    u, race = accept_noise(p, P, torch.Generator().manual_seed(1))
    twin = _run(sampled_accept_ref, p, proposal, u, race, buf)
    for device in kernel_devices():
        got = _run(sampled_accept, *(_to(x, device) for x in (p, proposal, u, race, buf)))
        assert all(torch.equal(got[k].cpu(), twin[k]) for k in twin)


def test_exact_ties_and_the_strict_accept(interpret):
    """Draws at their boundaries: u · q(d) == p(d) rejects (the test is strict); equal scores, within a chunk
    and across chunks, go to the first index (torch.argmax's rule); the full accept draws from p_P."""
    N, P = 2, 2
    p = torch.full((N, P + 1, V), 1.0 / V)
    p[0, 0] = 0.5 / (V - 1)
    p[0, 0, 5] = 0.5  # row 0: u_0 · q(5) = 0.5 · 1 == p(5): rejected; the residual is flat off token 5
    p[1, 0] = torch.nn.functional.one_hot(torch.tensor(7), V).float()  # row 1: both drafts accepted
    proposal = Proposal.point_mass(torch.tensor([[5, 6], [7, 8]]))
    u = torch.tensor([[0.5, 0.3], [0.99, 0.0]])
    race = torch.ones(N, V)  # every score of a row equal
    z = dict(dtype=torch.long)
    buf = _fresh_rows(N, limit=9, out=torch.zeros(N, 4, **z))
    twin = _run(sampled_accept_ref, p, proposal, u, race, buf)
    assert twin["log"][0, 1].tolist() == [0, 2] and twin["token"].tolist() == [0, 0]
    for device in kernel_devices():
        got = _run(sampled_accept, *(_to(x, device) for x in (p, proposal, u, race, buf)), block_v=BLOCK_V)
        assert all(torch.equal(got[k].cpu(), twin[k]) for k in twin)


def _many_chunk_rows(q):
    """4 rows over a vocabulary of 325 (21 chunks of 16, the last of 5), P = 2, q sparse (k = 3) or the same
    densified, built so that the bonus is known: (p, proposal, u, race, the bonuses).

    row 0: rejected at 0; residual maxima tie exactly at 290 and 305 (chunks 18 and 19): 290;
    row 1: both drafts accepted; the residual p_2 peaks at 323, in the partial last chunk;
    row 2: rejected at 1 with p_1 = q_1 / 2, a zero residual in every chunk: the fallback p_1 / race,
           whose maxima tie at 40 and 200 (chunks 2 and 12): 40;
    row 3: the same fallback, its maximum alone at 310 (chunk 19)."""
    Vm, N, P = 325, 4, 2
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[3, 50, 70], [9, 11, 13]]).repeat(N, 1, 1)
    ids[2:, 1] = torch.tensor([40, 200, 310])
    probs = torch.tensor([0.5, 0.25, 0.25]).repeat(N, P, 1)
    probs[2:, 1] = torch.tensor([0.4, 0.4, 0.2])
    drafts = ids[..., 0].contiguous()
    sparse = Proposal(drafts, ids, probs)
    p = torch.full((N, P + 1, Vm), 1e-3)
    p[0, 0, 3] = 0.01  # u · q(3) = 0.45 ≥ 0.01: rejected
    p[0, 0, [290, 305]] = 0.2
    p[1, 2, 323] = 0.3
    p[2:, 1] = sparse.densify(Vm)[2:, 1] / 2  # p_1(40) = 0.2 ≤ u · q_1(40) = 0.24: rejected, nothing left
    u = torch.tensor([[0.9, 0.0], [0.0, 0.0], [0.0, 0.6], [0.0, 0.6]])
    race = 0.05 + torch.empty(N, Vm).exponential_(generator=g)
    race[0, [290, 305]] = 0.01
    race[1, 323] = 0.01
    race[2, [40, 200]] = 0.5
    race[3, 310] = 0.01
    proposal = Proposal(drafts, dense=sparse.densify(Vm)) if q == "dense" else sparse
    return p, proposal, u, race, [290, 323, 40, 310]


@pytest.mark.parametrize("q", ["sparse", "dense"])
def test_many_chunks_late_maxima_ties_and_the_fallback(interpret, q):
    """The chunk partials' merge equals a global first-index argmax: maxima in late chunks (the last one
    partial), exact ties across chunks (the first index wins), the fallback where every chunk's residual is 0."""
    p, proposal, u, race, bonuses = _many_chunk_rows(q)
    N, P = u.shape
    z = dict(dtype=torch.long)
    buf = _fresh_rows(N, limit=9, out=torch.full((N, P + 2), -5, **z))
    twin = _run(sampled_accept_ref, p, proposal, u, race, buf)
    assert twin["log"][0, 1].tolist() == [0, 2, 1, 1] and twin["token"].tolist() == bonuses
    resid, _ = residual(p, with_q(proposal), twin["log"][0, 1])
    assert resid[:2].amax(-1).gt(0).all() and resid[2:].eq(0).all()  # rows 2 and 3 take the fallback
    for device in kernel_devices():
        for block_v in (16, 32, None):  # 21 chunks, 11 chunks, one chunk of 512
            got = _run(sampled_accept, *(_to(x, device) for x in (p, proposal, u, race, buf)), block_v=block_v)
            for k in twin:
                assert torch.equal(got[k].cpu(), twin[k]), (device, block_v, k)


def test_the_launches_at_qwen3_8b_vocabulary(interpret, monkeypatch):
    """At V = 151,936 (block 16, batch 1) the chunk launch has 149 programs per row, the finish one; a
    sparse q of k = 16 halves the chunk (its membership tile): 297."""
    import dflash2.runtime.kernels.sampled_accept as mod

    grids = []

    class Launch:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **k: grids.append((self.fn.__name__, grid, k.get("BLOCK_V")))

    monkeypatch.setattr(mod, "jit", lambda fn, **k: Launch(fn))
    Vq, P = 151_936, 15
    for device in kernel_devices():  # CPU tensors reach the kernel only under the interpreter
        d = dict(device=device)
        p, race = torch.zeros(1, P + 1, Vq, **d), torch.ones(1, Vq, **d)
        drafts = torch.zeros(1, P, dtype=torch.long, **d)
        z = dict(dtype=torch.long, **d)
        slots = [torch.tensor([-1, -1], **d), torch.ones(1, dtype=torch.bool, **d)]
        slots += [torch.zeros(1, **z) for _ in range(2)]
        slots += [torch.zeros(1, 32, **z), torch.zeros(1, **z), torch.zeros(1, **z)]
        ids = torch.arange(16, **d).repeat(1, P, 1)
        sparse = Proposal(drafts, ids, ids.float())
        for proposal, chunks, block in ((Proposal(drafts), 149, 1024), (sparse, 297, 512)):
            grids.clear()
            sampled_accept(p, proposal, torch.zeros(1, P, **d), race, *slots)
            want = [("_race_chunk_kernel", (1, chunks), block), ("_sampled_accept_finish_kernel", (1,), None)]
            assert grids == want, device


def test_kernels_off_runs_the_twin(monkeypatch):
    """``kernels(False)`` (and plain CPU tensors) never reach the kernel."""
    import dflash2.runtime.kernels.sampled_accept as mod

    monkeypatch.setattr(mod, "jit", lambda *a, **k: pytest.fail("the kernel ran"))
    p, proposal, buf = _inputs(4, 3, "sparse", seed=0)
    u, race = accept_noise(p, 3)
    with kernels.kernels(False):
        _run(sampled_accept, p, proposal, u, race, buf)


# ------------------------------------------------------------------ twin == the unfused path
def _clear_rows(p, proposal, u, race, margin=1e-4):
    """(N,) bool: rows whose bonus draw has no near-tie: in fp64 the best score beats the second by a
    relative margin far above fp32 rounding, so normalising the residual first cannot change the argmax."""
    proposal = with_q(proposal)
    a = accepted_prefix(p, proposal, u)
    as64 = lambda t: t if t is None or not t.is_floating_point() else t.double()
    resid, p_a = residual(
        p.double(), Proposal(*map(as64, (proposal.tokens, proposal.ids, proposal.probs, proposal.dense))), a
    )
    w = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_a) / race.double()
    top = w.topk(2, -1).values
    return (top[:, 0] - top[:, 1]) > margin * top[:, 0]


@pytest.mark.parametrize("q", ["point", "sparse", "dense"])
@pytest.mark.parametrize("P", [3, 7, 15])
def test_twin_equals_the_unfused_path(P, q):
    N = 3000
    p, proposal, buf = _inputs(N, P, q, seed=P)
    new = _run(sampled_accept_ref, p, proposal, *accept_noise(p, P, torch.Generator().manual_seed(9)), buf)
    old = _old_engine(p, proposal, 9, buf)
    assert torch.equal(new["log"][2, 1], old["log"][2, 1])  # the accepted counts, every row
    clear = _clear_rows(p, proposal, *accept_noise(p, P, torch.Generator().manual_seed(9)))
    assert clear.float().mean() > 0.99
    for k in ("count", "active", "commit_n", "token"):
        assert torch.equal(new[k][clear], old[k][clear]), k
    assert torch.equal(new["log"][:, :, clear], old["log"][:, :, clear])
    for r in clear.nonzero()[:, 0].tolist():  # emitted tokens equal; past them the old code wrote padding
        assert torch.equal(new["out"][r, : old["count"][r]], old["out"][r, : old["count"][r]])
    a, n = new["log"][2, 1], new["log"][2, 2]
    assert {0, 1, 2, P} <= set(a.tolist())  # rejections early and late, full accepts
    act = buf["active"]
    assert ((n < a + 1) & act).any() and (new["active"] < act).any()  # cuts (EOS, budget) and finishes


# ------------------------------------------------------------------ the law
def _law_rows(M, q, seed):
    """M copies of one row over 8 tokens: p (M, 4, 8), drafts (M, 3) drawn from q, and p_0, q_0 (8,)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(1, 4, 8, generator=g), -1)
    if q == "dense":
        q_dense = torch.softmax(2 * torch.randn(1, 3, 8, generator=g), -1)
        ids = probs = None
    else:  # 3 distinct ids per position
        ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(3)])[None]
        probs = torch.softmax(torch.randn(1, 3, 3, generator=g), -1)
        q_dense = torch.zeros(1, 3, 8).scatter_(-1, ids, probs)
    drafts = torch.multinomial(q_dense[0], M, replacement=True, generator=g).T.contiguous()  # (M, 3)
    tile = lambda t: None if t is None else t.expand(M, *t.shape[1:]).contiguous()
    proposal = Proposal(drafts, tile(ids), tile(probs), tile(q_dense if q == "dense" else None))
    return tile(p), proposal, p[0, 0], q_dense[0, 0]


def _check_law(fn, M, q, device, seed):
    p, proposal, p0, q0 = _law_rows(M, q, seed)
    z = dict(dtype=torch.long)
    buf = _fresh_rows(M, limit=10, out=torch.zeros(M, 8, **z))
    u, race = accept_noise(p, 3, torch.Generator().manual_seed(seed + 1))
    got = _run(fn, *(_to(x, device) for x in (p, proposal, u, race, buf)))
    first, a = got["out"][:, 0].cpu(), got["log"][0, 1].cpu()
    assert chi2_pvalue(first, p0) > PASS  # accepted draft or correction: p_0 either way
    resid = (p0 - q0).clamp_min(0)
    assert chi2_pvalue(first[a == 0], resid / resid.sum()) > PASS  # the correction alone: the residual's law
    assert (a == 0).any() and (a > 0).any()


@pytest.mark.parametrize("q", ["sparse", "dense"])
def test_twin_emits_the_target_law(q):
    _check_law(sampled_accept_ref, 40_000, q, "cpu", seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("q", ["sparse", "dense"])
def test_kernel_emits_the_target_law(interpret, q):
    """The same through the kernel: 40 000 rows on a GPU, 600 in the interpreter (a program takes ~10 ms)."""
    for device in kernel_devices():
        _check_law(sampled_accept, 40_000 if device == "cuda" else 600, q, device, seed=5)


# ------------------------------------------------------------------ whole generations
@pytest.mark.parametrize("drafts", ["v1-dense", "v1-point-mass", "dflash2-sparse"])
def test_decoder_through_the_kernel_equals_the_twin(hf_targets, monkeypatch, drafts):
    """T>0 generations (ragged rows, EOS inside a block, budget cuts) with the accept kernel (interpreter)
    == with the twin: the same tokens and per-row accepted / emitted counts from one seed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel through the interpreter")
    from test_runtime_engine import PROMPTS, TAPS

    import dflash2.runtime.kernels.sampled_accept as mod
    from dflash2.runtime import Decoder, load_model
    from dflash2.runtime.drafter import RuntimeDrafter
    from dflash2.target import TargetModel

    hf, folder = hf_targets["qwen3"]
    model = load_model(folder, target_layer_ids=TAPS)
    v2, argmax_drafts = drafts == "dflash2-sparse", drafts == "v1-point-mass"
    drafter = spec_drafter(TargetModel(hf, target_layer_ids=TAPS), 8 if v2 else 4, v2=v2, seed=2)
    drafter = RuntimeDrafter(nontrivial_dflash2(drafter) if v2 else drafter, model)
    runs, launches = [], []
    jit = mod.jit
    for fused in (False, True):
        with monkeypatch.context() as m:
            m.setattr(mod, "use_triton", lambda t, fused=fused: fused)
            m.setattr(mod, "jit", lambda *a, fused=fused, **k: launches.append(fused) or jit(*a, **k))
            dec = Decoder(model, drafter, max_len=64)
            kw = dict(temperature=1.0, top_k=20, argmax_drafts=argmax_drafts)
            res = [dec.generate_spec(PROMPTS, 25, generator=torch.Generator().manual_seed(1), **kw)]
            eos = res[0].sequences[0][10]  # the same seed again: row 0 now stops there, inside a block
            res.append(dec.generate_spec(PROMPTS, 21, eos, generator=torch.Generator().manual_seed(1), **kw))
            runs.append([(r.sequences, r.accepted_drafts, r.emitted) for r in res])
    assert runs[0] == runs[1] and launches and all(launches)  # the kernel ran, and only when fused
    accepted = [a for r in runs[0] for row in r[1] for a in row]
    assert 0 in accepted and max(accepted) > 0
    assert len(runs[0][1][0][0]) <= 11 and runs[0][1][0][0][-1] == runs[0][0][0][0][10]  # row 0 ended at its EOS
