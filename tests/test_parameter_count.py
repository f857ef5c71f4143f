"""Parameter counts and the capacity control of the ablation: v1 widened to DFlash2's count (issue 11)."""

import dataclasses

import pytest
from test_drafter_model import tiny

from dflash2.drafter import DFlashDrafter
from dflash2.drafter.from_target import drafter_config_for_target
from dflash2.drafter.parameter_count import dflash2_counterpart, parameter_count, widened_to_match
from dflash2.errors import DFlash2Error


@pytest.mark.parametrize("extras", [{}, {"use_local_conv": True}, {"use_selector": True}])
def test_count_is_the_built_drafters(extras):
    config = tiny(**extras)
    assert parameter_count(config) == sum(p.numel() for p in DFlashDrafter(config).parameters())


def test_widened_v1_has_dflash2s_count_within_one_mlp_unit():
    v1 = tiny(selector_rank=32)
    v2 = dflash2_counterpart(v1)
    matched = widened_to_match(v1, v2)
    one_unit = 3 * v1.hidden_size * v1.num_hidden_layers  # parameters per unit of intermediate_size
    assert parameter_count(v1) < parameter_count(v2)
    assert abs(parameter_count(matched) - parameter_count(v2)) <= one_unit / 2
    assert matched.intermediate_size > v1.intermediate_size
    assert dataclasses.replace(matched, intermediate_size=v1.intermediate_size) == v1  # nothing else changed
    assert not matched.is_v2


def test_widening_a_dflash2_config_is_refused():
    with pytest.raises(DFlash2Error, match="widens a DFlash v1 drafter") as err:
        widened_to_match(tiny(use_selector=True), dflash2_counterpart(tiny()))
    assert "\n" not in str(err.value)


def test_the_matched_config_option_widens_the_drafter_built_for_a_target(make_spec_target):
    target = make_spec_target("qwen3")
    settings = dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        block_size=4,
        mask_token_id=target.vocab_size - 1,
        use_local_conv=False,
        conv_kernel_size=2,
        conv_group_size=8,
        use_selector=False,
        selector_rank=16,
        selector_top_k=4,
    )
    plain = drafter_config_for_target(settings, target)
    matched = drafter_config_for_target({**settings, "match_dflash2_parameters": True}, target)
    goal = parameter_count(dflash2_counterpart(plain))
    assert abs(parameter_count(matched) - goal) <= 3 * plain.hidden_size / 2
    assert matched.intermediate_size > plain.intermediate_size and not matched.is_v2
    assert parameter_count(matched) > parameter_count(plain)
