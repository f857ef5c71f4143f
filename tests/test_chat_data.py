"""Chat data (issue 12 item 6): both layouts, bad rows counted, the template, splits, and the loss
mask: only the target's regenerated assistant tokens carry loss, so only they get anchors and labels."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dflash2.corpus import document_splits
from dflash2.data import regenerate
from dflash2.data.chat_format import (
    BadRow,
    RowCounts,
    conversation_messages,
    first_turn_prompt,
    render_prompt,
    resolve_template,
    turn_prompts,
)
from dflash2.data.chat_sources import iter_conversations
from dflash2.data.prompts import chat_prompt_batches
from dflash2.drafter.objective import block_labels, sample_anchors
from dflash2.errors import DFlash2Error
from dflash2.eval.prompts import load_prompts
from dflash2.target import TargetModel

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Answer in code."},
        {"from": "human", "value": "Add two numbers."},
        {"from": "gpt", "value": "def add(a, b):\n    return a + b"},
        {"from": "human", "value": "Now subtract."},
        {"from": "gpt", "value": "def sub(a, b):\n    return a - b"},
    ]
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Answer in code."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Now subtract."},
        {"role": "assistant", "content": "def sub(a, b):\n    return a - b"},
    ]
}
ONE_SPLIT = {"validation_fraction": 0.0, "heldout_fraction": 0.0, "near_duplicate_threshold": 0.5}


def chat_data(path, **extra) -> dict:
    """A plain data config whose conversations come from ``path`` (all rows in the train split)."""
    return {
        "sources": [{"kind": "stdlib"}],
        **ONE_SPLIT,
        "chat": {"conversations": [{"kind": "dataset", "path": str(path)}], "template": "auto"},
        "prompt_min_tokens": 1,
        "prompt_max_tokens": 200,
        "response_tokens": 12,
        "sampling": "greedy",
        "temperature": 1.0,
        "generation_batch_size": 4,
        **extra,
    }


def write_jsonl(path, rows) -> None:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


@pytest.fixture(scope="module")
def micro_target(micro_target_dir):
    return TargetModel.from_pretrained(str(micro_target_dir), target_layer_ids=[0, 1, 2], dtype="float32")


def test_both_layouts_parse_to_the_same_messages():
    sharegpt, openai = conversation_messages(SHAREGPT), conversation_messages(OPENAI)
    assert sharegpt == openai == OPENAI["messages"]
    # One prompt per assistant turn: everything before it, the dataset's own earlier reply included.
    assert turn_prompts(openai) == [openai[:2], openai[:4]]
    assert first_turn_prompt(openai) == openai[:2]  # what evaluation uses
    aliases = {"conversations": [{"from": "user", "value": "q"}, {"from": "chatgpt", "value": "a"}]}
    assert [m["role"] for m in conversation_messages(aliases)] == ["user", "assistant"]


@pytest.mark.parametrize(
    "row,reason",
    [
        ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]}, "unknown_role"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "observation", "value": "r"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": 3}]}, "malformed"),
        ({"text": "no conversation"}, "malformed"),
        (["a", "list"], "malformed"),
    ],
)
def test_unusable_rows_raise_bad_row_with_their_reason(row, reason):
    with pytest.raises(BadRow) as err:
        conversation_messages(row)
    assert err.value.reason == reason


def test_an_assistant_turn_needs_a_user_turn_before_it():
    with pytest.raises(BadRow) as err:
        turn_prompts([{"role": "user", "content": "only a question"}])
    assert err.value.reason == "no_assistant"
    lead = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}]
    lead.append({"role": "assistant", "content": "a"})
    assert turn_prompts(lead) == [lead[:2]]  # the greeting before any user turn is no training turn


def test_the_plain_template_renders_role_marker_lines(micro_target):
    tok = micro_target.tokenizer
    assert not tok.chat_template and resolve_template("auto", tok) == "plain"
    ids = render_prompt(OPENAI["messages"][:2], tok, "plain")
    text = "# <|system|>\nAnswer in code.\n# <|user|>\nAdd two numbers.\n# <|assistant|>\n"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(DFlash2Error, match="no chat template; use auto or plain"):
        resolve_template("tokenizer", tok)
    with pytest.raises(DFlash2Error, match=re.escape("data.chat.template='jinja'")):
        resolve_template("jinja", tok)
    own = tok.__class__.from_pretrained(micro_target.model.name_or_path)
    own.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
    assert resolve_template("auto", own) == "tokenizer"
    assert render_prompt([{"role": "user", "content": "q"}], own, "tokenizer") == own("[user]q[assistant]")["input_ids"]


def test_bad_rows_are_counted_and_skipped_never_raised(tmp_path, micro_target):
    path = tmp_path / "mixed.jsonl"
    rows = [
        SHAREGPT,
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
        "this line is not JSON",
        ["not", "an", "object"],
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]},
        {"messages": [{"role": "user", "content": "a question and no answer"}]},
        {"messages": [{"role": "user", "content": "long " * 400}, {"role": "assistant", "content": "a"}]},
    ]
    write_jsonl(path, rows)
    counts = RowCounts()
    data = chat_data(path)
    batches = chat_prompt_batches(
        iter_conversations(data, "train", 0, counts),
        micro_target.tokenizer,
        template="plain",
        num_prompts=None,
        max_tokens=200,
        batch_size=4,
        counts=counts,
    )
    assert counts.read == 7 and counts.turns == 3  # two ShareGPT turns + "Say hi."
    assert dict(counts.skipped) == {"malformed": 2, "unknown_role": 1, "no_assistant": 1, "over_long": 1}
    assert sum(b.input_ids.shape[0] for b in batches) == 3
    assert all(len(set(b.input_ids.shape[1:])) == 1 for b in batches)  # one length per batch: no padding
    assert counts.summary("chat") == (
        "chat: 7 conversations read, 3 assistant turns used; skipped: 2 malformed rows, "
        "1 rows without an assistant turn after a user turn, 1 turn prompts over data.prompt_max_tokens, "
        "1 rows with an unknown role"
    )


def test_regenerated_chat_rows_carry_loss_only_on_the_targets_assistant_tokens(tmp_path, micro_target, caplog):
    """The concrete two-turn conversation: row 2's prompt holds the system and user turns, the
    dataset's first reply and the template markers, all with mask 0; only the target's reply is 1,
    and anchors and labels land there only."""
    path = tmp_path / "one.jsonl"
    write_jsonl(path, [SHAREGPT])
    data = chat_data(path)
    with caplog.at_level("INFO"):
        ds = regenerate.regenerate_split(
            micro_target, data, split="train", num_prompts=None, seed=0, cache_dir=tmp_path, target_id="micro"
        )
    assert "chat data, train split: 1 conversations read, 2 assistant turns used; skipped: none" in caplog.messages
    tok = micro_target.tokenizer
    second = render_prompt(OPENAI["messages"][:4], tok, "plain")
    row = next(r for r in ds if r["prompt_len"] == len(second))
    ids, mask = row["input_ids"], row["loss_mask"]
    assert ids[: len(second)] == second  # the prompt is exactly the templated conversation
    response = ids[len(second) :]
    eos = tok.eos_token_id
    n = response.index(eos) + 1 if eos in response else len(response)
    assert mask == [0] * len(second) + [1] * n + [0] * (len(response) - n)
    # The drafter objective sees the same mask: anchors and labels only inside the response.
    input_ids, loss_mask = torch.tensor([ids]), torch.tensor([mask])
    anchors, valid = sample_anchors(loss_mask, 64, torch.Generator().manual_seed(0))
    assert valid.sum() == n - 1 and bool((anchors[valid] >= len(second)).all())
    labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, block_size=4)
    positions = anchors[:, :, None] + torch.arange(1, 4)
    assert bool((positions[label_mask] >= len(second)).all()) and int(label_mask.sum()) > 0
    assert torch.equal(labels[label_mask], input_ids[0][positions[label_mask]])  # no shift: slot k is anchor + k
    inside = positions < len(ids)
    supervised = loss_mask[0][positions.clamp(max=len(ids) - 1)].bool()
    assert torch.equal(inside & supervised & valid[..., None], label_mask)


def test_embedded_conversations_follow_their_documents_split():
    data = {"sources": [{"kind": "stdlib"}], **ONE_SPLIT, "validation_fraction": 0.02, "heldout_fraction": 0.02}
    data["chat"] = {"conversations": [{"kind": "embedded"}]}
    counts = RowCounts()
    heldout = list(iter_conversations(data, "heldout", 0, counts))
    splits = document_splits(data["sources"])
    documents = {c.key.removeprefix("chat:embedded:").rsplit(":", 1)[0] for c in heldout}
    assert len(heldout) > 36 and documents and all(splits[d] == "heldout" for d in documents)
    asks = [c.messages[0]["content"] for c in heldout]
    assert any(a.startswith("Write the Python module `") for a in asks)
    assert any(a.startswith("Complete this function:\ndef ") for a in asks)
    assert [c.key for c in iter_conversations(data, "heldout", 0, RowCounts())] == [c.key for c in heldout]
    assert [c.key for c in iter_conversations(data, "heldout", 1, RowCounts())] != [c.key for c in heldout]


def test_dataset_splits_keep_near_copies_together_and_exact_copies_once(tmp_path):
    rows = []
    for i in range(60):
        text = " ".join(f"word{i}x{j}" for j in range(60))
        rows += [
            {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "a"}]},
            {"conversations": [{"from": "human", "value": text + " please"}, {"from": "gpt", "value": "a"}]},
            {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "a"}]},  # exact copy
        ]
    path = tmp_path / "dups.jsonl"
    write_jsonl(path, rows)
    data = chat_data(path, validation_fraction=0.3, heldout_fraction=0.3)
    by_split = {s: list(iter_conversations(data, s, 0, RowCounts())) for s in ("train", "validation", "heldout")}
    assert sum(len(v) for v in by_split.values()) == 120  # exact copies kept once
    split_of_text = {}
    for split, conversations in by_split.items():
        for c in conversations:
            split_of_text.setdefault(c.messages[0]["content"].removesuffix(" please"), set()).add(split)
    assert all(len(s) == 1 for s in split_of_text.values())  # a near-copy never crosses splits
    assert all(by_split[s] for s in by_split)


def test_parquet_json_and_jsonl_files_hold_the_same_conversations(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [SHAREGPT, OPENAI, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "c.parquet")  # one layout per parquet file
    found = {}
    for name in ("a.jsonl", "b.json", "c.parquet"):
        counts = RowCounts()
        found[name] = sorted(
            c.key.split(":")[-1] for c in iter_conversations(chat_data(tmp_path / name), "train", 0, counts)
        )
        assert not counts.skipped
    # ShareGPT and OpenAI rows of one conversation are one conversation (kept once).
    assert found["a.jsonl"] == found["b.json"] == found["c.parquet"] and len(found["a.jsonl"]) == 2
    folder = list(iter_conversations(chat_data(tmp_path), "train", 0, RowCounts()))
    assert sorted(c.key.split(":")[-1] for c in folder) == found["a.jsonl"]


def test_a_missing_file_or_bad_source_is_a_one_line_error(tmp_path, micro_target):
    for conversations, needle in [
        ([{"kind": "dataset", "path": str(tmp_path / "missing.jsonl")}], "does not exist"),
        ([{"kind": "dataset"}], "needs a path"),
        ([{"kind": "embeded"}], "kind embedded or dataset"),
        ([{"kind": "embedded", "path": "x"}], "unknown keys ['path']"),
        ([{"kind": "dataset", "path": "no-such-owner/no-such-chat-set"}], "the hub is unreachable here"),
    ]:
        data = chat_data(tmp_path, chat={"conversations": conversations, "template": "auto"})
        with pytest.raises(DFlash2Error, match=re.escape(needle)) as err:
            list(iter_conversations(data, "train", 0, RowCounts()))
        assert "\n" not in str(err.value)


def test_eval_prompt_files_take_both_layouts_up_to_the_first_assistant_turn(tmp_path, micro_target, caplog):
    tok = micro_target.tokenizer
    path = tmp_path / "chat.jsonl"
    tool = {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]}
    write_jsonl(path, [SHAREGPT, OPENAI, tool, {"prompt": "Add two numbers."}])
    with caplog.at_level("WARNING"):
        plain = load_prompts(str(path), tok, training_data=_chat_record())
    expected = render_prompt(OPENAI["messages"][:2], tok, "plain")
    assert [p.ids for p in plain[:2]] == [expected, expected] and plain[0].text == "Add two numbers."
    assert plain[2].ids == render_prompt([{"role": "user", "content": "Add two numbers."}], tok, "plain")
    assert [p.source for p in plain] == ["chat.jsonl:1", "chat.jsonl:2", "chat.jsonl:4"]
    assert any("skipped 1 rows with an unknown role" in m for m in caplog.messages)
    # A drafter not trained on chat: a tokenizer without a template gets the turns as plain text.
    raw = load_prompts(str(path), tok)
    assert raw[0].ids == tok("Answer in code.\nAdd two numbers.")["input_ids"]


def _chat_record() -> dict:
    """What a drafter trained with data=chat on the embedded set records."""
    from dflash2.data.split_record import training_data_record

    data = {"sources": [{"kind": "stdlib"}], "validation_fraction": 0.02, "heldout_fraction": 0.02}
    data.update(chat={"conversations": [{"kind": "embedded"}]}, prompt_max_tokens=160)
    return training_data_record(data, seed=0, chat_template="plain")
