"""Same seed, same backbone: the initialisation that makes the v1 vs DFlash2 ablation fair (issue 11)."""

import pytest
import torch
from test_drafter_model import tiny

from dflash2.drafter import DFlashDrafter
from dflash2.drafter.initialisation import is_backbone_parameter

VARIANTS = {
    "v1": {},
    "conv only": {"use_local_conv": True},
    "selector only": {"use_selector": True},
    "dflash2": {"use_local_conv": True, "use_selector": True},
}


def backbone(drafter) -> dict[str, torch.Tensor]:
    return {k: v for k, v in drafter.state_dict().items() if is_backbone_parameter(k)}


def test_every_variant_starts_from_the_same_backbone_bit_for_bit():
    states = {name: backbone(DFlashDrafter(tiny(**kw), init_seed=7)) for name, kw in VARIANTS.items()}
    reference = states["v1"]
    assert set(reference) == set(DFlashDrafter(tiny()).state_dict())  # v1's keys are exactly the backbone
    for name, state in states.items():
        assert set(state) == set(reference), name
        different = [k for k in reference if not torch.equal(reference[k], state[k])]
        assert different == [], f"{name}: {different}"


def test_same_seed_through_the_global_rng_gives_the_same_backbone_too():
    """The old call pattern (seed the global RNG, then build) is fair as well: one draw, before any module."""
    states = {}
    for name, kw in VARIANTS.items():
        torch.manual_seed(3)
        states[name] = backbone(DFlashDrafter(tiny(**kw)))
        states[name]["global rng after the build"] = torch.rand(4)
    for name, state in states.items():
        assert all(torch.equal(states["v1"][k], state[k]) for k in state), name


def test_the_selector_starts_the_same_with_or_without_the_conv():
    alone = DFlashDrafter(tiny(use_selector=True), init_seed=5).candidate_selector.state_dict()
    with_conv = DFlashDrafter(tiny(use_local_conv=True, use_selector=True), init_seed=5).candidate_selector.state_dict()
    assert all(torch.equal(alone[k], with_conv[k]) for k in alone)
    assert 0.01 < float(alone["predecessor_codebook"].std()) < 0.03  # its small N(0, 0.02²) init


def test_other_seeds_give_other_weights_and_the_conv_stays_identity():
    a = DFlashDrafter(tiny(use_local_conv=True), init_seed=0).state_dict()
    b = DFlashDrafter(tiny(use_local_conv=True), init_seed=1).state_dict()
    assert not torch.equal(a["fc.weight"], b["fc.weight"])
    assert not torch.equal(a["layers.1.mlp.up_proj.weight"], b["layers.1.mlp.up_proj.weight"])
    assert abs(float(a["fc.weight"].std()) - 0.02) < 0.003  # N(0, 0.02²), HF Qwen3 initializer_range
    kernel = a["layers.0.attention_conv.base_kernel"]
    assert torch.equal(kernel[:, 0], torch.ones_like(kernel[:, 0])) and not kernel[:, 1:].any()
    assert not a["layers.0.attention_conv.kernel_projection.weight"].any()


def test_a_fresh_conv_variant_computes_what_fresh_v1_computes_at_the_same_seed():
    """Identity conv at init + the same backbone: the conv variant starts as the same function as v1."""
    v1 = DFlashDrafter(tiny(), init_seed=11).eval()
    conv = DFlashDrafter(tiny(use_local_conv=True), init_seed=11).eval()
    generator = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(96, 32)
    args = (
        torch.randn(2, 12, 32, generator=generator),  # taps: 2 tapped layers x target width 16
        torch.randint(0, 96, (2, 12), generator=generator),
        embed,
        torch.tensor([[3, 7], [1, 6]]),
        torch.ones(2, 2, dtype=torch.bool),
    )
    with torch.no_grad():
        assert torch.equal(v1.training_forward(*args), conv.training_forward(*args))


@pytest.mark.cuda
def test_built_under_a_cuda_device_context_the_weights_equal_the_cpu_build():
    """eval.speedup builds its random drafter under ``with torch.device("cuda")``: the seeded streams
    still draw on the CPU (a CPU generator cannot fill a CUDA tensor), so the weights are the same."""
    config = tiny(use_local_conv=True, use_selector=True)
    with torch.device("cuda"):
        on_gpu = DFlashDrafter(config, init_seed=5)
    on_cpu = DFlashDrafter(config, init_seed=5)
    for k, v in on_cpu.state_dict().items():
        assert torch.equal(on_gpu.state_dict()[k].cpu(), v), k
