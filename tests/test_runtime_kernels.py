"""The runtime's Triton kernels (dflash2.runtime.kernels) against their plain-PyTorch twins.

On the CPU they run through Triton's interpreter (conftest sets TRITON_INTERPRET=1 on
machines without a GPU; ``kernels.on_cpu()`` sends CPU tensors to the kernels): fp32 to
rounding, bf16 to a few units in the last place (the interpreter's fp32 -> bf16 cast
does not round to nearest, the GPU's does). On a GPU: bf16 to one unit in the last
place. Also: a whole model forward with every kernel equals the twins' forward, the hybrid with
and without the GDN output norm's kernel agree (and decode HF's greedy tokens with it), fused
projections share memory with the HF-named parameters, and poisoned outputs are fully
overwritten.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from kernel_devices import kernel_devices

from dflash2.runtime import kernels, load_model
from dflash2.runtime.kernels import gated_norm
from dflash2.runtime.kernels.act import silu_mul, silu_mul_ref
from dflash2.runtime.kernels.gated_norm import gated_rms_norm, gated_rms_norm_ref
from dflash2.runtime.kernels.norm import add_rms_norm, add_rms_norm_ref
from dflash2.runtime.kernels.output_gate import output_gate, output_gate_ref
from dflash2.runtime.kernels.rope import qk_norm_rope_write, qk_norm_rope_write_ref, split_qkv

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=0.02, atol=0.07)}


def _assert_close(a, b, dtype, device):
    tol = TOL[dtype] if device == "cpu" or dtype == torch.float32 else dict(rtol=0.008, atol=0.008)  # one bf16 ulp
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm(interpret, dtype, offset, residual):
    for device in kernel_devices():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 5, 40, generator=g).to(device, dtype)
        r = torch.randn(3, 5, 40, generator=g).to(device, dtype) if residual else None
        w = torch.randn(40, generator=g).to(device, dtype)
        h, y = add_rms_norm(x, r, w, 1e-6, offset)
        h_ref, y_ref = add_rms_norm_ref(x, r, w, 1e-6, offset)
        _assert_close(h, h_ref, dtype, device)
        _assert_close(y, y_ref, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("taps_rows", ["even", "uneven"])
def test_add_rms_norm_strided_into_h_out(interpret, dtype, offset, taps_rows):
    """x, residual and h_out strided views (unit last stride, rows wider than D), as the target's norms get them
    when h_out is a layer's (N, T, d) slice of the (N, T, K·d) taps (models/base.py ``_tap``) and x that slice on
    the next norm: read and written in place, h returned as h_out itself, nothing outside it touched; the same
    bits as the launch on contiguous copies, and the twin's (``torch.add(x, r, out=h_out)``) values. "uneven": a
    taps buffer sliced in T too (rows not one stride apart): h goes through a temporary, then a copy."""
    N, T, D, K = 2, 3, 40, 3
    for device in kernel_devices():
        g = torch.Generator().manual_seed(6)
        x = torch.randn(N, T, 2 * D + 8, generator=g).to(device, dtype)[..., 5 : 5 + D]  # rows 2D + 8 apart
        r = torch.randn(N, T, D + 3, generator=g).to(device, dtype)[..., 3:]  # rows D + 3 apart
        w = torch.randn(D, generator=g).to(device, dtype)
        rows = T if taps_rows == "even" else T + 2
        taps = torch.full((N, rows, K * D), float("nan"), dtype=dtype, device=device)
        ref_taps = taps.clone()
        h_out, ref_out = taps[:, :T, D : 2 * D], ref_taps[:, :T, D : 2 * D]
        h, y = add_rms_norm(x, r, w, 1e-6, offset, h_out=h_out)
        assert h is h_out and y.shape == x.shape and y.is_contiguous()
        h_c, y_c = add_rms_norm(x.contiguous(), r.contiguous(), w, 1e-6, offset)
        assert torch.equal(h_out, h_c) and torch.equal(y, y_c)  # strides change no bit
        h_ref, y_ref = add_rms_norm_ref(x, r, w, 1e-6, offset, h_out=ref_out)
        assert h_ref is ref_out
        if dtype == torch.float32 or device == "cuda":  # one fp32 add, rounded to nearest: the twin's bits
            assert torch.equal(h_out, ref_out)
        else:  # the interpreter's fp32 -> bf16 cast truncates (module docstring)
            _assert_close(h_out, ref_out, dtype, device)
        _assert_close(y, y_ref, dtype, device)
        outside = torch.ones(N, rows, K * D, dtype=torch.bool)
        outside[:, :T, D : 2 * D] = False
        assert taps[outside.to(device)].isnan().all()
        # the next norm reads that slice as its x (the residual stream through the taps), no copy
        h2, y2 = add_rms_norm(h_out, r, w, 1e-6, offset)
        h2_c, y2_c = add_rms_norm(h_out.contiguous(), r.contiguous(), w, 1e-6, offset)
        assert torch.equal(h2, h2_c) and torch.equal(y2, y2_c)


def test_add_rms_norm_cpu_h_out_is_the_eager_add():
    """Outside ``on_cpu()`` CPU tensors run the twin: h_out gets ``torch.add(x, r)``'s bits, y the plain call's."""
    g = torch.Generator().manual_seed(7)
    x, r = (torch.randn(2, 3, 24, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(24, generator=g).bfloat16()
    taps = torch.zeros(2, 3, 48, dtype=torch.bfloat16)
    h, y = add_rms_norm(x, r, w, 1e-6, True, h_out=taps[..., 24:])
    assert h.data_ptr() == taps[..., 24:].data_ptr() and torch.equal(taps[..., 24:], torch.add(x, r))
    assert torch.equal(y, add_rms_norm(x, r, w, 1e-6, True)[1]) and not taps[..., :24].any()


def test_add_rms_norm_refuses_an_h_out_that_does_not_fit():
    x, r, w = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.ones(8)
    for fn in (add_rms_norm, add_rms_norm_ref):
        with pytest.raises(ValueError, match="without a residual"):
            fn(x, None, w, 1e-6, False, h_out=torch.zeros(2, 3, 8))
        with pytest.raises(ValueError, match="shape"):
            fn(x, r, w, 1e-6, False, h_out=torch.zeros(2, 3, 9))
        with pytest.raises(ValueError, match="last stride"):
            fn(x, r, w, 1e-6, False, h_out=torch.zeros(2, 3, 16)[..., ::2])
        with pytest.raises(ValueError, match="must match"):
            fn(x, r, w, 1e-6, False, h_out=torch.zeros(2, 3, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(interpret, dtype):
    for device in kernel_devices():
        gu = torch.randn(2, 3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        _assert_close(silu_mul(gu), silu_mul_ref(gu), dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,T,H,Hkv,D", [(2, 5, 4, 2, 24), (1, 1, 3, 1, 96), (3, 16, 16, 2, 256)])
def test_output_gate(interpret, dtype, N, T, H, Hkv, D):
    """Gated attention's y · sigmoid(gate), with the gate a strided slice of a fused q|gate|k|v projection
    and y the attention's (N, H, T, D) output (as Attention.forward hands them), against the twin."""
    assert kernel_devices(), "no device runs the kernel: TRITON_INTERPRET=1 (conftest) or a GPU"
    for device in kernel_devices():
        g = torch.Generator().manual_seed(N + T + D)
        qkv = torch.randn(N, T, 2 * H * D + 2 * Hkv * D, generator=g).to(device, dtype)
        gate = split_qkv(qkv, H, Hkv, D, True)[1]  # (N, T, H, D) view
        y = torch.randn(N, H, T, D, generator=g).to(device, dtype)
        got = output_gate(y, gate)
        assert got.shape == (N, T, H * D) and got.is_contiguous() and got.dtype == dtype
        _assert_close(got, output_gate_ref(y, gate), dtype, device)


def test_output_gate_refuses_a_gate_of_another_shape():
    with pytest.raises(ValueError, match="gate must be"):
        output_gate(torch.zeros(1, 2, 3, 4), torch.zeros(1, 3, 2, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 5, 96), (1, 1, 4, 128), (7, 3, 40), (3, 1, 33)])
def test_gated_rms_norm(interpret, dtype, shape):
    """The GDN output norm (x, z (..., G, D)): head dims 96 / 128 and odd ones, odd row counts, G heads
    per row; z a column slice of a wider projection (not contiguous), as in the GDN layer. Rounded at the
    twin's three points (tolerances: the module docstring)."""
    *lead, G, D = shape
    for device in kernel_devices():
        g = torch.Generator().manual_seed(4)
        x = torch.randn(*shape, generator=g).to(device, dtype)
        proj = torch.randn(*lead, 3 + G * D + 5, generator=g).to(device, dtype)
        z = proj[..., 3 : 3 + G * D].reshape(shape)  # a view: rows G·D + 8 apart
        assert z.stride(-2) == D and (z.dim() < 3 or z.shape[-3] == 1 or z.stride(-3) == G * D + 8)
        w = (1.0 + 0.5 * torch.randn(D, generator=g)).to(device, dtype)
        y = gated_rms_norm(x, z, w, 1e-6)
        assert y.shape == x.shape and y.dtype == dtype and y.isfinite().all()
        _assert_close(y, gated_rms_norm_ref(x, z, w, 1e-6), dtype, device)


def test_gated_rms_norm_cpu_is_the_eager_code():
    """Outside ``on_cpu()`` (and with kernels switched off) CPU tensors run the twin: bit for bit the eager ops."""
    g = torch.Generator().manual_seed(5)
    x, z = torch.randn(2, 3, 4, 24, generator=g).bfloat16(), torch.randn(2, 3, 4, 24, generator=g).bfloat16()
    w = torch.randn(24, generator=g).bfloat16()
    x32 = x.float()
    eager = (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * F.silu(z.float())).to(
        x.dtype
    )
    assert torch.equal(gated_rms_norm(x, z, w, 1e-6), eager)
    with kernels.kernels(False):
        assert torch.equal(gated_rms_norm(x, z, w, 1e-6), eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["qwen3", "qwen3_5_gated_partial", "llama_no_norm"])
def test_qk_norm_rope_write(interpret, dtype, variant):
    gated, norm = variant.startswith("qwen3_5"), variant != "llama_no_norm"
    N, T, H, Hkv, D, S = 2, 3, 4, 2, 16, 20
    R = D // 4 if gated else D
    W = H * D * (2 if gated else 1) + 2 * Hkv * D
    for device in kernel_devices():
        g = torch.Generator().manual_seed(2)
        qkv = torch.randn(N, T, W, generator=g).to(device, dtype)
        qw = torch.randn(D, generator=g).to(device, dtype) if norm else None
        kw = torch.randn(D, generator=g).to(device, dtype) if norm else None
        cos, sin = (torch.randn(N, 1, T, R, generator=g).to(device, dtype) for _ in range(2))
        pos = torch.tensor([[3, 4, 5], [0, 1, 2]], device=device)
        cache = torch.full((2, 3, N, Hkv, S, D), float("nan"), dtype=dtype, device=device)  # poison
        ref_cache = cache.clone()
        shape = dict(num_heads=H, num_kv_heads=Hkv, head_dim=D, gated=gated, eps=1e-6, offset=gated)
        q = qk_norm_rope_write(qkv, qw, kw, cos, sin, pos, cache[0, 1], cache[1, 1], **shape)
        q_ref = qk_norm_rope_write_ref(qkv, qw, kw, cos, sin, pos, ref_cache[0, 1], ref_cache[1, 1], **shape)
        _assert_close(q, q_ref, dtype, device)
        written = torch.zeros(S, dtype=torch.bool)
        written[pos.flatten().cpu()] = True
        for n in range(N):  # exactly the block's positions of each row were written, nothing else
            cols = pos[n].cpu()
            _assert_close(cache[:, 1, n][:, :, cols], ref_cache[:, 1, n][:, :, cols], dtype, device)
            others = torch.tensor([s for s in range(S) if s not in cols.tolist()])
            assert cache[:, 1, n][:, :, others].isnan().all()
        assert cache[:, [0, 2]].isnan().all()  # other layers' slots untouched


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_model_forward_with_kernels_equals_twins(interpret, hf_targets, device):
    """A whole forward (prefill + a verify block) of every family with every kernel on (decode attention
    too: the default backend, for both blocks of ≤ 16 tokens) == twins and SDPA only."""
    if device not in kernel_devices():
        pytest.skip(f"no {device} kernels here")
    for kind in ("qwen3", "llama", "qwen3_5"):
        model = load_model(hf_targets[kind][1], device=device, target_layer_ids=[0, 1])
        ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3)).to(device)
        outs = []
        for on in (True, False):
            with kernels.kernels(on):
                state = model.new_state(2, 32)
                model(ids, state, logits_index=torch.tensor([8, 5], device=device))
                state.commit(torch.tensor([9, 6], device=device))
                out = model(ids[:, :4], state)
                outs.append((out.logits, out.taps, state.kv.k.clone(), state.kv.v.clone()))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def gated_norm_twin_calls(monkeypatch):
    """A list that grows by one at every call of the GDN output norm's twin (the kernel path never calls it)."""
    calls = []
    real_ref = gated_norm.gated_rms_norm_ref

    def spy(*args):
        calls.append(1)
        return real_ref(*args)

    monkeypatch.setattr(gated_norm, "gated_rms_norm_ref", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_gdn_output_norm_kernel(interpret, hf_targets, monkeypatch, gated_norm_twin_calls, dtype):
    """The hybrid's forward (prefill + a verify block) with the GDN output norm's kernel == with its twin.

    Only that kernel changes between the two runs (the other kernels stay on), and a spy checks the GDN
    layers really took the kernel (no twin call) with kernels on and the twin with them off. Tolerance:
    fp32 as the whole-model test. bf16: the interpreter's truncating cast biases every rounding of the
    kernel the same way, and the differences grow through the layers and both forwards: logits (std
    ~0.5, |max| < 2, a bf16 ulp 2⁻⁷ there) measured up to 0.072 apart, 0.009-0.014 on average; the
    other kernels on vs off move the same logits by up to 0.15 (0.024 on average). So 0.1 at most,
    0.02 on average."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU half runs under the interpreter; the GPU half is the whole-model test")
    calls = gated_norm_twin_calls
    model = load_model(hf_targets["qwen3_5"][1], dtype=dtype, target_layer_ids=[0, 1])
    n_gdn = sum(layer.kind == "linear_attention" for layer in model.layers)
    assert n_gdn > 0
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(6))
    outs = []
    for on in (True, False):
        calls.clear()
        monkeypatch.setattr(gated_norm, "use_triton", (lambda t: kernels.use_triton(t)) if on else (lambda t: False))
        state = model.new_state(2, 32)
        first = model(ids, state, logits_index=torch.tensor([8, 5]))
        state.commit(torch.tensor([9, 6]))
        out = model(ids[:, :4], state)
        assert len(calls) == (0 if on else 2 * n_gdn)
        outs.append((first.logits.float(), out.logits.float(), *(t.float() for t in out.taps)))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.1, atol=0.1)
    for a, b in zip(*outs):
        if dtype == torch.bfloat16:
            assert (a - b).abs().mean() < 0.02  # ~2 bf16 ulps of these logits on average
        torch.testing.assert_close(a, b, **tol)


def test_hybrid_greedy_with_the_gdn_output_norm_kernel_equals_hf(hf_targets, monkeypatch, gated_norm_twin_calls):
    """fp32 greedy AR decoding of the hybrid, its GDN output norms through the kernel (interpreter; the other
    kernels stay twins), emits HF's greedy tokens, ragged batch included."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter run; on a GPU the engine tests run every kernel")
    from dflash2.decoding import greedy_generate
    from dflash2.runtime.engine import generate_ar
    from dflash2.target import TargetModel

    calls = gated_norm_twin_calls
    monkeypatch.setattr(gated_norm, "use_triton", lambda t: kernels.enabled())
    hf, folder = hf_targets["qwen3_5"]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (7, 3, 12)]
    expected = greedy_generate(TargetModel(hf, target_layer_ids=[0, 1]), prompts, 13)
    model = load_model(folder, target_layer_ids=[0, 1])
    assert generate_ar(model, prompts, 13) == expected
    assert not calls  # every GDN output norm ran the kernel


def test_fused_projections_share_memory(hf_targets):
    model = load_model(hf_targets["qwen3_5"][1])
    attn = next(m for m in model.modules() if type(m).__name__ == "Attention")
    mlp = model.layers[0].mlp
    gdn = model.layers[0].gdn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() > attn.k_proj.weight.data_ptr() > attn.q_proj.weight.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[mlp.gate_proj.weight.shape[0] :].data_ptr()
    assert gdn.in_proj_qkv.weight.data_ptr() == gdn.in_proj_weight.data_ptr()
    keys = set(model.state_dict())
    assert not any("qkv_weight" in k or "gate_up" in k or "in_proj_weight" in k for k in keys)
