"""The two-stage top-k kernel (dflash2/runtime/kernels/topk.py) against its twin, a stable descending sort.

Values are copies and indices integers, so everything is asserted exactly, ties included: equal values
come out by ascending index. Runs through Triton's interpreter on the CPU (conftest), for real on a GPU.
"""

import pytest
import torch
from kernel_devices import kernel_devices

from dflash2.runtime.kernels.topk import topk_rows, topk_rows_ref


def _devices() -> list[str]:
    devices = kernel_devices()
    assert devices, "no device runs the kernel: TRITON_INTERPRET=1 (conftest) or a GPU"
    return devices


def _check(x: torch.Tensor, k: int, **kw):
    got_v, got_i = topk_rows(x, k, **kw)
    want_v, want_i = topk_rows_ref(x, k)
    assert got_v.dtype == x.dtype and got_i.dtype == torch.long
    assert got_v.shape == got_i.shape == (*x.shape[:-1], k)
    assert torch.equal(got_i.cpu(), want_i.cpu())
    assert torch.equal(got_v.cpu(), want_v.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "V,k",
    [(37, 1), (37, 16), (1024, 16), (1027, 16), (3000, 7), (8192, 16)],  # one chunk; a short last chunk; several
)
def test_random_rows_equal_the_stable_sort(interpret, dtype, V, k):
    for device in _devices():
        g = torch.Generator().manual_seed(V + k)
        x = torch.randn(2, 7, V, generator=g).to(device, dtype)  # (N, P, V): the drafter's block of logits
        _check(x, k)


@pytest.mark.parametrize("chunk", [16, 64, 1024])
def test_ties_go_to_the_lower_index_in_every_stage(interpret, chunk):
    """Few distinct values (ties everywhere, across chunks), -inf entries, a row of -inf only, k = V."""
    for device in _devices():
        g = torch.Generator().manual_seed(chunk)
        x = torch.randint(0, 4, (5, 300), generator=g).float()
        x[1, ::3] = float("-inf")
        x[2] = float("-inf")  # nothing but ties: the first k indices
        x[3, 250:] = 9.0  # the winners all sit in the last chunks
        x[4, :] = 0.0
        x[4, -1] = -0.0  # equal to 0.0 for the order, as in the sort
        x = x.to(device)
        for k in (1, 5, 16):
            _check(x, k, chunk=chunk)
        _check(x[:, :16], 16, chunk=chunk)  # k = V


def test_a_short_last_chunk_with_fewer_than_k_values(interpret):
    """V = 2·chunk + 3: the last chunk has 3 values and leaves k − 3 empty finalists that must never win,
    even against real -inf values elsewhere in the row."""
    for device in _devices():
        x = torch.full((2, 2 * 64 + 3), float("-inf"))
        x[0, -3:] = torch.tensor([1.0, 3.0, 2.0])
        x = x.to(device)
        _check(x, 8, chunk=64)
        _, i = topk_rows(x, 8, chunk=64)
        assert i[0].tolist() == [129, 130, 128, 0, 1, 2, 3, 4] and i[1].tolist() == list(range(8))


def test_the_fallback_off_the_kernel_path_is_torch_topk():
    """Outside the interpreter's on_cpu() (no `interpret` fixture) the CPU runs torch.topk: same values."""
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    v, i = topk_rows(x, 9)
    want_v, want_i = torch.topk(x, 9, dim=-1)
    assert torch.equal(v, want_v) and torch.equal(i, want_i)


def test_k_out_of_range_is_refused():
    with pytest.raises(ValueError, match="1 <= k <= V"):
        topk_rows(torch.zeros(2, 5), 6)
    with pytest.raises(ValueError, match="1 <= k <= V"):
        topk_rows(torch.zeros(2, 5), 0)
