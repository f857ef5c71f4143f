"""Acceptance evaluation: files, τ statistics, the lossless check, prompt sets, bad inputs, the CLI."""

import dataclasses
import importlib
import json
import logging
import sys
from itertools import pairwise

import pytest
import torch

from dflash2.corpus import document_splits, load_documents
from dflash2.drafter import DFlashDrafter, save_drafter
from dflash2.errors import DFlash2Error
from dflash2.eval import acceptance as acceptance_mod
from dflash2.eval import acceptance_cli, evaluate_acceptance, load_prompts
from dflash2.eval.acceptance import FILES
from dflash2.target import TargetModel
from dflash2.tokenizer import train_bpe_tokenizer

VOCAB = 320  # covers the 300-token BPE below


@pytest.fixture(scope="module")
def saved(tmp_path_factory, make_spec_target, make_spec_drafter):
    """A random hybrid target saved with a byte-level BPE tokenizer, and a DFlash2 drafter (B=4) for it."""
    root = tmp_path_factory.mktemp("eval")
    docs = load_documents([{"kind": "stdlib"}], "train", max_documents=10)
    tokenizer = train_bpe_tokenizer(docs, vocab_size=300, max_train_bytes=100_000)
    target = make_spec_target("qwen3_5", vocab_size=VOCAB)
    target.model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    target.tokenizer = tokenizer
    drafter = make_spec_drafter(target, 4, v2=True)
    save_drafter(drafter, root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n\n{"prompt": "import os\\nimport sys"}\n')
    return {"root": root, "target": target, "drafter": drafter, "prompts": prompts}


def test_writes_all_files_and_is_lossless(saved, tmp_path, caplog):
    target, drafter = saved["target"], saved["drafter"]
    too_long = list(range(3, 60))  # 57 + 16 new + 3 drafted > max_context 64
    with caplog.at_level(logging.WARNING):
        res = evaluate_acceptance(
            target,
            drafter,
            ["def add(a, b):", too_long, [5, 6, 7]],
            max_new_tokens=16,
            output_dir=tmp_path,
            max_context=64,
            show_progress=False,
        )
    assert all((tmp_path / f).is_file() for f in FILES)
    assert res["lossless"] is True and res["first_mismatch"] is None
    assert res["num_prompts"] == 2 and res["skipped_prompts"] == 1 and res["skipped"][0]["index"] == 1
    assert "skipping prompt 1" in caplog.text
    # τ statistics are consistent with each other
    hist, rates = res["accepted_length_histogram"], res["per_position_acceptance"]
    assert len(hist) == 4 and len(rates) == 3 and sum(hist) == res["steps"] > 0
    assert all(r1 >= r2 for r1, r2 in pairwise(rates))  # position k needs 1..k-1 accepted
    assert res["mean_tau"] == pytest.approx(1 + sum(rates))
    assert res["mean_tau"] == pytest.approx(sum((k + 1) * c for k, c in enumerate(hist)) / res["steps"])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["lossless"] is True and on_disk["settings"]["block_size"] == 4
    assert on_disk["settings"]["temperature"] == 0.0 and on_disk["settings"]["check_lossless"] is True
    rows = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 2] and rows[0]["prompt"] == "def add(a, b):"
    assert all(len(r["generated_ids"]) <= 16 and r["lossless"] for r in rows)
    assert rows[1]["generated_text"] == target.tokenizer.decode(rows[1]["generated_ids"])
    assert sum(len(r["accepted_lengths"]) for r in rows) == res["steps"]
    assert "mean τ" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "tau_histogram.png").read_bytes()[:4] == b"\x89PNG"


def test_mismatch_is_reported_with_the_logit_margin(saved, monkeypatch):
    real = acceptance_mod.greedy_generate

    def corrupted(target, prompts, n, eos):  # a baseline that disagrees at token 3
        out = real(target, prompts, n, eos)
        out[0][3] = (out[0][3] + 1) % VOCAB
        return out

    monkeypatch.setattr(acceptance_mod, "greedy_generate", corrupted)
    res = evaluate_acceptance(
        saved["target"], saved["drafter"], [[5, 6, 7], [8, 9]], max_new_tokens=8, eos_token_id=None, show_progress=False
    )
    assert res["lossless"] is False
    mm = res["first_mismatch"]
    assert (mm["prompt_index"], mm["token_index"]) == (0, 3)
    assert mm["greedy_token"] == (mm["spec_token"] + 1) % VOCAB
    assert mm["logit_margin"] < 0  # the corrupted "greedy" token is not the target's argmax


def test_sampling_run_and_settings_errors(saved):
    res = evaluate_acceptance(
        saved["target"], saved["drafter"], [[5, 6, 7]], max_new_tokens=6, temperature=1.0, show_progress=False
    )
    assert res["lossless"] is None and res["settings"]["check_lossless"] is False and res["steps"] >= 1
    with pytest.raises(DFlash2Error, match="temperature=0"):
        evaluate_acceptance(saved["target"], saved["drafter"], [[5]], temperature=1.0, check_lossless=True)
    with pytest.raises(DFlash2Error, match="empty"):
        evaluate_acceptance(saved["target"], saved["drafter"], [])
    with pytest.raises(DFlash2Error, match="all 1 prompts were skipped"):
        evaluate_acceptance(saved["target"], saved["drafter"], [[5] * 70], max_context=64, show_progress=False)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(vocab_size=VOCAB + 64), "vocab"),
        (dict(hidden_size=48, target_hidden_size=48, head_dim=12, conv_group_size=8), "hidden size"),
        (dict(target_layer_ids=[0, 5]), "taps"),
        (dict(target_layer_ids=[0, 2]), "target layers"),
        (dict(target_tokenizer_fingerprint="0123456789abcdef"), "tokenizer fingerprint 0123456789abcdef vs target"),
    ],
)
def test_drafter_for_another_target_is_refused(saved, change, message):
    cfg = dataclasses.replace(saved["drafter"].config, **change)
    with pytest.raises(DFlash2Error, match=message):
        evaluate_acceptance(saved["target"], DFlashDrafter(cfg), [[5, 6]], max_new_tokens=4)


# ------------------------------------------------------------------ prompt sets
def test_jsonl_prompts_and_chat_template(saved, tmp_path):
    tok = saved["target"].tokenizer
    prompts = load_prompts(str(saved["prompts"]), tok)
    assert [p.text for p in prompts] == ["def add(a, b):", "import os\nimport sys"]  # blank line skipped
    assert prompts[0].ids == tok("def add(a, b):")["input_ids"] and prompts[1].source.endswith(":3")
    chat = tok.__class__.from_pretrained(saved["root"] / "target")
    chat.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    ids = load_prompts(str(saved["prompts"]), chat, num_prompts=1)[0].ids
    assert ids == chat("<user>def add(a, b):\n<assistant>", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"prompt": "ok"}\n{"prompt": "fine"}\n{"prompt": 3}\n', "line 3"),
        ('{"prompt": "ok"}\nnot json\n', "line 2"),
        ('["a list"]\n', "line 1"),
        ('{"text": "wrong key"}\n', "line 1"),
        ("\n\n", "empty"),
    ],
)
def test_bad_prompt_files_name_the_line(saved, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DFlash2Error, match=message) as err:
        load_prompts(str(path), saved["target"].tokenizer)
    assert "\n" not in str(err.value)
    if message.startswith("line"):
        assert str(path) in str(err.value)


def test_heldout_prompts_are_fixed_length_passages_of_heldout_files(saved):
    prompts = load_prompts("heldout", saved["target"].tokenizer, num_prompts=2, prompt_tokens=16)
    assert len(prompts) == 2 and all(len(p.ids) == 16 for p in prompts)
    splits = document_splits([{"kind": "stdlib"}])
    assert all(splits[p.source] == "heldout" for p in prompts)
    with pytest.raises(DFlash2Error, match="no tokenizer"):
        load_prompts("heldout", None)
    with pytest.raises(DFlash2Error, match="not found"):
        load_prompts("missing.jsonl", saved["target"].tokenizer)


# ------------------------------------------------------------------ CLI (Hydra)
def _cli(monkeypatch, *overrides):
    pytest.importorskip("hydra")  # a project dependency, but absent from some bare GPU images
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    monkeypatch.setattr(
        sys, "argv", ["eval.acceptance", *overrides, "hydra/job_logging=none", "hydra/hydra_logging=none"]
    )
    acceptance_cli.main()


def test_cli_writes_results_from_saved_folders(saved, tmp_path, monkeypatch, caplog):
    assert importlib.import_module("eval.acceptance").main is acceptance_cli.main  # the `python -m` shim
    out = tmp_path / "out"
    caplog.set_level(logging.INFO, logger="dflash2")
    _cli(
        monkeypatch,
        f"target={saved['root'] / 'target'}",
        f"drafter={saved['root'] / 'drafter'}",
        f"prompts={saved['prompts']}",
        "max_new_tokens=8",
        f"paths.output_dir={out}",
    )
    assert all((out / f).is_file() for f in FILES)
    assert (out / ".hydra" / "config.yaml").is_file()  # Hydra's record lands beside the results
    res = json.loads((out / "results.json").read_text())
    assert res["lossless"] is True and res["num_prompts"] == 2
    assert res["settings"]["prompts"] == str(saved["prompts"]) and any(
        m.startswith("mean tau ") for m in caplog.messages
    )
    # the same target loaded back from disk decodes exactly like the in-memory one
    loaded = TargetModel.from_pretrained(str(saved["root"] / "target"), target_layer_ids=[0, 1])
    torch.testing.assert_close(loaded(torch.tensor([[5, 6]])).logits, saved["target"](torch.tensor([[5, 6]])).logits)


def test_cli_out_of_gpu_memory_names_the_knobs_and_writes_nothing(saved, tmp_path, monkeypatch, capsys):
    def oom(*args, **kwargs):  # torch.cuda.OutOfMemoryError is this class; raising it on CPU tests the handling
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(acceptance_mod, "evaluate_acceptance", oom)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        _cli(
            monkeypatch,
            f"target={saved['root'] / 'target'}",
            f"drafter={saved['root'] / 'drafter'}",
            f"prompts={saved['prompts']}",
            "max_new_tokens=8",
            f"paths.output_dir={out}",
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the weight-loading progress bar
    assert (
        err.startswith(
            "error: out of GPU memory during speculative decoding; lower one of max_new_tokens=8, prompt_tokens=64"
        )
        and "dtype=bfloat16" in err
    )
    assert err.endswith("or free the GPU of other processes")  # the whole message is this one line
    assert not any((out / f).exists() for f in FILES)


def test_cli_user_error_is_one_line(saved, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli(monkeypatch, f"drafter={tmp_path / 'nope'}", f"paths.output_dir={tmp_path}")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: drafter folder") and "\n" not in err


def test_cli_damaged_drafter_folder_is_one_line_and_writes_nothing(saved, tmp_path, monkeypatch, capsys):
    """A truncated model.safetensors (issue 12) used to end in a safetensors traceback from load_drafter."""
    import shutil

    drafter = shutil.copytree(saved["root"] / "drafter", tmp_path / "drafter")
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        _cli(monkeypatch, f"target={saved['root'] / 'target'}", f"drafter={drafter}", f"paths.output_dir={out}")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: drafter weights file {weights} is corrupted or truncated") and "\n" not in err
    assert not any((out / f).exists() for f in FILES)
