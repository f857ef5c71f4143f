"""A drafter is tied to its target's tokenizer, not only to its vocab size (issue 6)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from dflash2.corpus import load_documents
from dflash2.drafter.from_target import check_drafter_matches_target, drafter_config_for_target
from dflash2.errors import DFlash2Error
from dflash2.tokenizer import tokenizer_fingerprint, train_bpe_tokenizer

VOCAB = 300

DRAFTER_SETTINGS = dict(
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    block_size=4,
    use_local_conv=False,
    conv_kernel_size=2,
    conv_group_size=8,
    use_selector=False,
    selector_rank=8,
    selector_top_k=4,
    mask_token_id=None,
)


@pytest.fixture(scope="module")
def two_tokenizers():
    """Two BPEs with the same vocab size and special ids, learned from different files."""
    docs = load_documents([{"kind": "stdlib"}], "train", max_documents=40)
    first = train_bpe_tokenizer((d.text for d in docs[:20]), vocab_size=VOCAB, max_train_bytes=100_000)
    second = train_bpe_tokenizer((d.text for d in docs[20:]), vocab_size=VOCAB, max_train_bytes=100_000)
    assert len(first) == len(second) and first.mask_token_id == second.mask_token_id
    return first, second


def test_fingerprint_survives_save_and_load_and_tells_tokenizers_apart(two_tokenizers, tmp_path):
    first, second = two_tokenizers
    first.save_pretrained(tmp_path)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path)) == tokenizer_fingerprint(first)
    assert tokenizer_fingerprint(first) != tokenizer_fingerprint(second)


def test_drafter_of_another_tokenizer_is_refused(two_tokenizers, make_spec_target):
    first, second = two_tokenizers
    target = make_spec_target("qwen3", vocab_size=VOCAB)
    target.tokenizer = first
    config = drafter_config_for_target(DRAFTER_SETTINGS, target)
    assert config.target_tokenizer_fingerprint == tokenizer_fingerprint(first)
    check_drafter_matches_target(config, target)  # its own target passes

    target.tokenizer = second  # same vocab size, widths and taps: only the tokenizer differs
    with pytest.raises(DFlash2Error, match=r"trained for another target .*tokenizer fingerprint") as err:
        check_drafter_matches_target(config, target)
    assert "\n" not in str(err.value)
    # A drafter from elsewhere that records no tokenizer is judged on sizes alone.
    check_drafter_matches_target(dataclasses.replace(config, target_tokenizer_fingerprint=None), target)
