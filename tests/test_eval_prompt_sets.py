"""Held-out / out-of-domain prompt sets, the train-split refusal and the prompt records (issue 11)."""

import json
import logging
import sys

import pytest

from dflash2.corpus import document_splits, load_documents
from dflash2.data.split_record import DEFAULT_RECORD, training_data_record
from dflash2.drafter import save_drafter
from dflash2.errors import DFlash2Error
from dflash2.eval import acceptance_cli, evaluate_acceptance
from dflash2.eval.prompts import prompt_set
from dflash2.tokenizer import train_bpe_tokenizer

STDLIB = [{"kind": "stdlib"}]
VOCAB = 320


@pytest.fixture(scope="module")
def tokenizer():
    docs = load_documents(STDLIB, "train", max_documents=10)
    return train_bpe_tokenizer(docs, vocab_size=300, max_train_bytes=100_000)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer, make_spec_target, make_spec_drafter):
    """A saved random target with the tokenizer, and two copies of one drafter: with a data record, without."""
    root = tmp_path_factory.mktemp("prompt_sets")
    target = make_spec_target("qwen3_5", vocab_size=VOCAB)
    target.model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    target.tokenizer = tokenizer
    drafter = make_spec_drafter(target, 4)
    save_drafter(drafter, root / "unrecorded")
    drafter.config.training_data = training_data_record(
        {"sources": STDLIB, "validation_fraction": 0.02, "heldout_fraction": 0.02, "near_duplicate_threshold": 0.5},
        seed=3,
    )
    save_drafter(drafter, root / "recorded")
    return {"root": root, "target": target, "drafter": drafter}


def _keys(ps):
    return [(p.source, p.offset) for p in ps.prompts]


# ------------------------------------------------------------------ heldout sampling
def test_heldout_sample_is_seeded_random_and_from_the_heldout_split(tokenizer):
    first = prompt_set("heldout", tokenizer, num_prompts=8, prompt_tokens=16, seed=0)
    assert _keys(first) == _keys(prompt_set("heldout", tokenizer, num_prompts=8, prompt_tokens=16, seed=0))
    other = prompt_set("heldout", tokenizer, num_prompts=8, prompt_tokens=16, seed=1)
    assert _keys(other) != _keys(first)
    splits = document_splits(STDLIB)
    heldout = sorted(k for k, s in splits.items() if s == "heldout")
    keys = [p.source for p in first.prompts]
    assert all(splits[k] == "heldout" for k in keys) and len(set(keys)) == 8
    assert keys != heldout[:8] and sorted(keys) != heldout[: len(keys)]  # not the first files in key order
    texts = {d.key: d.text for d in load_documents(STDLIB, "heldout")}
    assert any(p.offset > 0 for p in first.prompts)  # not only file heads
    for p in first.prompts:
        assert p.ids == tokenizer(texts[p.source], add_special_tokens=False)["input_ids"][p.offset : p.offset + 16]
    assert first.info["prompts"] == [{"key": k, "offset": o} for k, o in _keys(first)]
    assert first.info["data_split"]["sources"] == STDLIB and first.info["seed"] == 0


def test_several_prompts_per_document_and_file_heads(tokenizer):
    many = prompt_set("heldout", tokenizer, num_prompts=9, prompt_tokens=16, prompts_per_document=3, seed=0)
    by_doc = {}
    for key, offset in _keys(many):
        by_doc.setdefault(key, []).append(offset)
    assert len(by_doc) == 3 and all(len(set(o)) == 3 for o in by_doc.values())
    heads = prompt_set("heldout", tokenizer, num_prompts=4, prompt_tokens=16, position="head", seed=0)
    assert {p.offset for p in heads.prompts} == {0}
    with pytest.raises(DFlash2Error, match="needs prompt_position=random"):
        prompt_set("heldout", tokenizer, prompts_per_document=2, position="head")


def test_fewer_prompts_than_asked_say_why(tokenizer):
    ps = prompt_set("heldout", tokenizer, num_prompts=30, prompt_tokens=4000, seed=0)
    too_short = ps.info["documents_passed_over"]["too_short"]
    assert 0 < ps.info["made"] < 30 and too_short > 0
    assert ps.info["shortfall"].startswith(f"{ps.info['made']} of 30 prompts asked: the held-out split has")
    assert f"{too_short} shorter than prompt_tokens=4000" in ps.info["shortfall"]


# ------------------------------------------------------------------ prompt files
def _file(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": line}) + "\n" for line in lines))
    return path


def test_a_file_is_evaluated_whole_unless_a_count_is_asked(tokenizer, tmp_path):
    path = _file(tmp_path, [f"def f{i}(x):" for i in range(24)])
    whole = prompt_set(str(path), tokenizer)
    assert whole.info["made"] == whole.info["in_file"] == 24 and whole.info["shortfall"] is None
    five = prompt_set(str(path), tokenizer, num_prompts=5)
    assert (
        len(five.prompts) == 5 and five.info["shortfall"] == f"the first 5 of the 24 prompts in {path} (num_prompts=5)"
    )
    more = prompt_set(str(path), tokenizer, num_prompts=30)
    assert len(more.prompts) == 24 and more.info["shortfall"] == f"24 of 30 prompts asked: {path} has 24"
    assert whole.info["train_split_check"]["passed"] is True


def test_a_prompt_from_the_train_split_is_refused_naming_the_document(tokenizer, tmp_path):
    train = {d.key: d.text for d in load_documents(STDLIB, "train")}
    key = "stdlib:json/decoder.py"
    passage = train[key][1000:1400]
    path = _file(tmp_path, ["def add(a, b):", passage.replace("\n", "\n\t")])  # re-indented: still found
    with pytest.raises(DFlash2Error) as err:
        prompt_set(str(path), tokenizer)
    message = str(err.value)
    assert message.startswith("prompt prompts.jsonl:2 is a passage of stdlib:json/decoder.py, a document of")
    assert "\n" not in message
    small = min((k for k, t in train.items() if 150 < len(t) < 400), key=lambda k: (len(train[k]), k))
    wrapped = _file(tmp_path, ["Explain this file:\n" + train[small] + "\nThanks."])
    with pytest.raises(DFlash2Error, match=f"prompts.jsonl:1 contains {small}, a document"):
        prompt_set(str(wrapped), tokenizer)
    heldout = next(d.text for d in load_documents(STDLIB, "heldout") if len(d.text) > 2000)
    assert prompt_set(str(_file(tmp_path, [heldout[500:900]])), tokenizer).info["made"] == 1  # held-out text is fine


# ------------------------------------------------------------------ out-of-domain
@pytest.mark.slow  # lists ~20k site-packages files
def test_ood_prompts_come_from_site_packages_and_are_refused_for_runs_that_trained_on_it(tokenizer):
    ps = prompt_set("ood", tokenizer, num_prompts=6, prompt_tokens=16, seed=0)
    assert len(ps.prompts) == 6 and all(p.source.startswith("dir:site-packages:") for p in ps.prompts)
    assert ps.info["set"] == "ood" and ps.info["documents_available"] > 100
    trained_on_it = {**DEFAULT_RECORD, "sources": [*STDLIB, {"kind": "dir", "path": "site-packages"}]}
    with pytest.raises(DFlash2Error, match=r"prompts=ood .* but this drafter trained on .*data.sources\[1\]"):
        prompt_set("ood", tokenizer, training_data=trained_on_it)


# ------------------------------------------------------------------ what results record
def test_results_record_the_prompt_set_and_fewer_prompts(folders, tmp_path, caplog):
    target, drafter = folders["target"], folders["drafter"]
    ps = prompt_set("heldout", target.tokenizer, num_prompts=3, prompt_tokens=40, seed=2)
    ps.prompts[1].ids = ps.prompts[1].ids * 2  # 80 tokens + 8 new + 3 drafted > max_context 64: skipped
    with caplog.at_level(logging.WARNING):
        res = evaluate_acceptance(
            target, drafter, ps.prompts, max_new_tokens=8, max_context=64, output_dir=tmp_path, prompt_set=ps.info
        )
    counts = res["prompt_counts"]
    assert counts == {
        "asked": 3,
        "given": 3,
        "evaluated": 2,
        "notes": ["1 of 3 given prompts skipped: 1 longer than the context limit 64 with the new tokens"],
    }
    assert "evaluated 2 prompts (asked 3, given 3): 1 of 3 given prompts skipped" in caplog.text
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["prompt_set"]["prompts"] == [{"key": p.source, "offset": p.offset} for p in ps.prompts]
    assert saved["prompt_set"]["data_split"]["near_duplicate_threshold"] == 0.5
    assert "fewer prompts" in (tmp_path / "results.md").read_text()
    rows = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert [(r["source"], r["offset"]) for r in rows] == [_keys(ps)[0], _keys(ps)[2]]


def _cli(monkeypatch, *overrides):
    pytest.importorskip("hydra")
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    monkeypatch.setattr(
        sys, "argv", ["eval.acceptance", *overrides, "hydra/job_logging=none", "hydra/hydra_logging=none"]
    )
    acceptance_cli.main()


def test_cli_uses_the_recorded_split_and_records_it(folders, tmp_path, monkeypatch, capsys, caplog):
    root = folders["root"]
    common = [f"target={root / 'target'}", "max_new_tokens=6", "num_prompts=3", "prompt_tokens=24", "prompt_seed=5"]
    _cli(monkeypatch, f"drafter={root / 'recorded'}", f"paths.output_dir={tmp_path / 'a'}", *common)
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    recorded = res["prompt_set"]
    assert recorded["data_split_recorded"] is True and recorded["data_split"]["seed"] == 3
    assert recorded["data_split"]["sources"] == STDLIB and recorded["data_split"]["heldout_fraction"] == 0.02
    assert recorded["seed"] == 5 and len(recorded["prompts"]) == res["num_prompts"] == 3
    assert res["prompt_counts"]["notes"] == [] and "note:" not in capsys.readouterr().out
    with caplog.at_level(logging.WARNING):
        _cli(monkeypatch, f"drafter={root / 'unrecorded'}", f"paths.output_dir={tmp_path / 'b'}", *common)
    assert "does not record the data it was trained on; assuming the default data config" in caplog.text
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["prompt_set"]["data_split_recorded"] is False and res["prompt_set"]["data_split"]["seed"] is None
    assert res["prompt_set"]["prompts"] == recorded["prompts"]  # same split, same seed: same prompts


def test_cli_says_when_fewer_prompts_were_evaluated(folders, tmp_path, monkeypatch, caplog):
    root = folders["root"]
    path = _file(tmp_path, [f"x{i} = {i}" for i in range(24)])
    _cli(
        monkeypatch,
        f"target={root / 'target'}",
        f"drafter={root / 'recorded'}",
        f"prompts={path}",
        "num_prompts=16",
        "max_new_tokens=4",
        f"paths.output_dir={tmp_path / 'out'}",
    )
    # said once on the console (a warning of dflash2.eval.acceptance), and recorded in results.json
    said = f"evaluated 16 prompts (asked 16, given 16): the first 16 of the 24 prompts in {path}"
    assert [r.levelname for r in caplog.records if said in r.getMessage()] == ["WARNING"]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["num_prompts"] == 16 and res["settings"]["num_prompts_asked"] == 16
    assert res["prompt_set"]["in_file"] == 24
