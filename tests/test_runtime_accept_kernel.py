"""The T=0 accept in one launch (dflash2/runtime/kernels/accept.py): kernel == twin == the step functions.

Integer-only, so every comparison is exact: the Triton kernel (through the interpreter on the CPU, for
real on a GPU), its plain-PyTorch twin, and what ``step.accept_greedy`` + ``finish_step`` + ``emit``
(the engine's accept before the fusion) give, on the edge cases of a block: all / no drafts
accepted, EOS at the first / a middle / the last position (and past the accepted prefix), a budget
cut mid-block, finished rows, ragged rows, AR steps (no drafts).
"""

import os

import pytest
import torch
from kernel_devices import kernel_devices

from dflash2.runtime import kernels
from dflash2.runtime.kernels.accept import greedy_accept, greedy_accept_ref
from dflash2.runtime.step import accept_greedy, emit, finish_step

EOS = 7
E_SLOTS = 4  # padded with -1 as the engine's slot pads its 16


def _devices():
    """Where the kernel runs (kernel_devices). Never empty: without the interpreter or a GPU, the CPU, where
    ``greedy_accept`` is the twin, so the twin is still checked against the old engine's functions."""
    return kernel_devices() or ["cpu"]


def _slot(argmax, drafts, active, count, limit, eos=(EOS,), device="cpu"):
    """The slot's buffers the accept touches, as the engine holds them (out / log poisoned with -5)."""
    N, B = argmax.shape
    z = dict(dtype=torch.long, device=device)
    e = torch.full((E_SLOTS,), -1, **z)
    e[: len(eos)] = torch.tensor(eos, **z)
    return dict(
        argmax=argmax.to(device),
        drafts=drafts.to(device),
        eos=e,
        active=active.to(device),
        count=count.to(device),
        limit=limit.to(device),
        out=torch.full((N, int(count.max()) + B + 3), -5, **z),
        commit_n=torch.full((N,), -5, **z),
        token=torch.arange(100, 100 + N, **z),
        log=torch.full((4, 3, N), -5, **z),
        step=torch.tensor([2], **z),
    )


def _clone(buf):
    return {k: v.clone() for k, v in buf.items()}


def _run(fn, buf, spec):
    b = _clone(buf)
    extra = dict(log=b["log"], step=b["step"]) if spec else dict(commit_finishing=True)
    names = ("argmax", "drafts", "eos", "active", "count", "limit", "out", "commit_n", "token")
    fn(*(b[k] for k in names), **extra)
    return b


def _old_engine(buf, spec):
    """The engine's accept as it was: step.py's functions (tokens past count + n are padding there)."""
    b = _clone(buf)
    finish = dict(active=b["active"], eos_token_id=b["eos"], budget=b["limit"] - b["count"])
    if spec:
        acc = accept_greedy(b["argmax"], b["drafts"], **finish)
        b["commit_n"].copy_(torch.where(acc.finished, 0, acc.commit))
    else:
        acc = finish_step(torch.zeros_like(b["count"]), b["argmax"][:, 0], b["drafts"], **finish)
        b["commit_n"].copy_(acc.commit)
    n_before = b["count"].clone()
    b["count"].copy_(emit(b["out"], b["count"], acc.tokens, acc.num_emitted))
    if spec:
        b["log"][int(b["step"])] = torch.stack([b["active"].long(), acc.num_accepted, acc.num_emitted])
    b["active"].copy_(b["active"] & ~acc.finished)
    b["token"].copy_(torch.where(b["active"], acc.next_anchor, b["token"]))
    return b, n_before


def _check(buf, spec):
    twin = _run(greedy_accept_ref, buf, spec)
    old, start = _old_engine(buf, spec)
    for k in ("count", "active", "commit_n", "token", "log"):
        assert torch.equal(twin[k], old[k]), k
    for r in range(buf["argmax"].shape[0]):  # emitted tokens equal; past them the old code wrote padding
        assert torch.equal(twin["out"][r, : old["count"][r]], old["out"][r, : old["count"][r]])
        assert torch.equal(twin["out"][r, : start[r]], buf["out"][r, : start[r]].to(twin["out"].device))
    got = _run(greedy_accept, buf, spec)
    for k in twin:
        assert torch.equal(got[k], twin[k]), k  # the whole buffers: the kernel writes what the twin writes


def _cases():
    """(argmax, drafts, active, count, limit) of B = 5 blocks, one row per edge case."""
    d = [3, 4, 5, 6]
    rows = [
        # argmax             drafts         active count limit
        ([3, 4, 5, 6, 9], d, True, 0, 50),  # all accepted, bonus 9
        ([1, 4, 5, 6, 9], d, True, 2, 50),  # none accepted
        ([3, 4, 1, 6, 9], d, True, 1, 50),  # two accepted
        ([EOS, 4, 5, 6, 9], [EOS, 4, 5, 6], True, 0, 50),  # EOS at the first position (accepted)
        ([EOS, 4, 5, 6, 9], d, True, 0, 50),  # EOS as the bonus at position 0
        ([3, 4, EOS, 6, 9], [3, 4, EOS, 6], True, 3, 50),  # EOS mid-block, accepted further
        ([3, 4, EOS, 6, 9], [3, 4, 5, 6], True, 3, 50),  # EOS mid-block as the bonus
        ([3, 4, 5, 6, EOS], d, True, 0, 50),  # EOS at the last position (the bonus after a full accept)
        ([3, 1, 5, EOS, 9], d, True, 0, 50),  # EOS past the accepted prefix: not emitted, not finished
        ([3, 4, 5, 6, 9], d, True, 10, 12),  # budget cut mid-block (2 of 5)
        ([3, 4, 5, 6, 9], d, True, 10, 15),  # budget exactly the block
        ([3, 4, 1, 6, 9], d, True, 10, 13),  # budget exactly the emitted (3): finishes
        ([3, 4, EOS, 6, 9], [3, 4, EOS, 6], True, 10, 12),  # budget and EOS at once
        ([3, 4, 5, 6, 9], d, False, 7, 50),  # finished rows: nothing emitted or committed
        ([EOS, 4, 5, 6, 9], d, False, 12, 12),
    ]
    am, dr, act, cnt, lim = (torch.tensor(c) for c in zip(*rows))
    return am, dr, act, cnt, lim


def test_edge_cases_emit_and_finish_as_the_rule_says(interpret):
    """The speculative edge cases' expected outcome, written out (the other tests compare implementations)."""
    am, dr, act, cnt, lim = _cases()
    for device in _devices():
        buf = _slot(am, dr, act, cnt, lim, device=device)
        got = _run(greedy_accept, buf, spec=True)
        emitted = (got["count"] - buf["count"]).tolist()
        assert emitted == [5, 1, 3, 1, 1, 3, 3, 5, 2, 2, 5, 3, 2, 0, 0]
        still = [True, True, True, False, False, False, False, False, True] + [False] * 6
        assert got["active"].tolist() == still
        assert got["out"][0, :5].tolist() == [3, 4, 5, 6, 9] and got["out"][6, 3:6].tolist() == [3, 4, EOS]


@pytest.mark.parametrize("spec", [True, False])
def test_edge_cases(interpret, spec):
    am, dr, act, cnt, lim = _cases()
    if not spec:  # AR: the argmax is the chosen token, no drafts
        am, dr = am[:, :1], dr[:, :0]
    for device in _devices():
        _check(_slot(am, dr, act, cnt, lim, device=device), spec)


@pytest.mark.parametrize("B", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("eos", [(), (EOS,), (EOS, 2, 0)])
def test_random_ragged_rows(interpret, B, eos):
    """Random blocks over a vocabulary of 8 (many matches and EOS), ragged counts and budgets, mixed activity."""
    g = torch.Generator().manual_seed(B * 10 + len(eos))
    N = 9
    for device in _devices():
        for _ in range(4):
            am = torch.randint(0, 8, (N, B), generator=g)
            dr = torch.where(torch.rand(N, B - 1, generator=g) < 0.7, am[:, :-1], torch.randint(0, 8, (N, B - 1)))
            cnt = torch.randint(0, 20, (N,), generator=g)
            lim = cnt + torch.randint(0, B + 2, (N,), generator=g)
            act = (torch.rand(N, generator=g) < 0.8) & (lim > cnt)  # the engine's invariant: active rows have budget
            _check(_slot(am, dr, act, cnt, lim, eos=eos, device=device), spec=B > 1)
            if B == 1:
                _check(_slot(am, dr, act, cnt, lim, eos=eos, device=device), spec=False)


def test_kernels_off_runs_the_twin(monkeypatch):
    """``kernels(False)`` (and plain CPU tensors) never reach the kernel."""
    import dflash2.runtime.kernels.accept as accept

    monkeypatch.setattr(accept, "jit", lambda *a, **k: pytest.fail("the kernel ran"))
    am, dr, act, cnt, lim = _cases()
    with kernels.kernels(False):
        _run(greedy_accept, _slot(am, dr, act, cnt, lim), True)


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_decoder_through_the_kernel_equals_the_twin(hf_targets, monkeypatch, block_size):
    """Whole generations (ragged acceptance, EOS inside a block, a budget cut) with the accept kernel
    (interpreter) == with the twin: the same tokens and per-row accepted / emitted counts."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel through the interpreter")
    from test_runtime_engine import PROMPTS, TAPS, ScriptedProposer

    import dflash2.runtime.kernels.accept as accept
    from dflash2.decoding import greedy_generate
    from dflash2.runtime import Decoder, load_model
    from dflash2.target import TargetModel

    hf, folder = hf_targets["qwen3"]
    model = load_model(folder, target_layer_ids=TAPS)
    gen = greedy_generate(TargetModel(hf, target_layer_ids=TAPS), PROMPTS, 40)
    full = [p + g for p, g in zip(PROMPTS, gen)]
    eos = gen[0][11]  # inside row 0's continuation
    runs, launches = [], []
    jit = accept.jit
    for fused in (False, True):
        with monkeypatch.context() as m:
            m.setattr(accept, "use_triton", lambda t, fused=fused: fused)
            m.setattr(accept, "jit", lambda *a, fused=fused, **k: launches.append(fused) or jit(*a, **k))
            if block_size == 1:
                dec = Decoder(model, max_len=64)
                runs.append([dec.generate_ar(PROMPTS, n, eos_token_id=e) for n, e in ((33, eos), (21, None))])
            else:
                proposer = ScriptedProposer(
                    full, ["oracle", "partial", "wrong", "partial"], block_size, model.vocab_size
                )
                dec = Decoder(model, proposer, max_len=64)
                res = [dec.generate_spec(PROMPTS, n, eos_token_id=e) for n, e in ((33, eos), (21, None))]
                runs.append([(r.sequences, r.accepted_drafts, r.emitted) for r in res])
    assert runs[0] == runs[1] and launches and all(launches)  # the kernel ran, and only when fused
    sequences = runs[0][0] if block_size == 1 else runs[0][0][0]
    assert sequences[0] == gen[0][: gen[0].index(eos) + 1]  # row 0 stopped at its EOS
