"""`python train.py data=chat` end to end on the micro target (issue 12 item 6): the offline chat set
is regenerated and trained on with loss on assistant tokens only, the drafter records it, and
`eval.acceptance` measures τ on held-out chat prompts (losslessly) and on a chat file in either layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from transformers import AutoTokenizer

from dflash2.corpus import document_splits
from dflash2.data.chat_format import render_prompt
from dflash2.drafter import load_drafter
from dflash2.eval import acceptance_cli, load_prompts
from dflash2.training.cli import CONFIG_DIR
from dflash2.training.run import run_from_config

pytestmark = pytest.mark.slow

# Chat prompts of the micro tokenizer (vocab 320) run to ~100 tokens: the code-prompt budget of the
# micro overrides would skip them all.
CHAT_OVERRIDES = ["data=chat", "data.prompt_max_tokens=96", "data.num_train_prompts=16", "data.num_val_prompts=6"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, micro_train_overrides):
    tmp = tmp_path_factory.mktemp("chat")
    keep = [o for o in micro_train_overrides if not o.startswith(("data.prompt_max_tokens", "data.num_"))]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={tmp / 'run'}", *keep, *CHAT_OVERRIDES])
    GlobalHydra.instance().clear()
    return tmp, run_from_config(cfg)


def _cli(monkeypatch, *overrides) -> dict:
    GlobalHydra.instance().clear()
    argv = ["eval.acceptance", *overrides, "hydra/job_logging=none", "hydra/hydra_logging=none"]
    monkeypatch.setattr(sys, "argv", argv)
    acceptance_cli.main()
    out = next(o.split("=", 1)[1] for o in overrides if o.startswith("paths.output_dir="))
    return json.loads((Path(out) / "results.json").read_text())


def test_chat_run_trains_and_records_the_chat_data(chat_run):
    tmp, summary = chat_run
    report = summary["drafter"]
    assert report["steps"] == 6 and report["heldout_blocks"] > 0
    drafter = load_drafter(tmp / "run" / "drafter")
    chat = drafter.config.training_data["chat"]
    # The micro target's tokenizer has no chat template of its own: the plain role-marker one was used.
    assert chat == {"conversations": [{"kind": "embedded"}], "template": "plain", "prompt_max_tokens": 96}


def test_eval_acceptance_on_heldout_chat_prompts_is_lossless(chat_run, micro_target_dir, tmp_path, monkeypatch):
    tmp, _ = chat_run
    res = _cli(
        monkeypatch,
        f"drafter={tmp / 'run' / 'drafter'}",
        f"target={micro_target_dir}",
        "num_prompts=4",
        "max_new_tokens=12",
        f"paths.output_dir={tmp_path / 'heldout'}",
    )
    assert res["lossless"] is True and res["num_prompts"] == 4 and res["mean_tau"] >= 1.0
    prompt_set = res["prompt_set"]
    assert prompt_set["chat"] is True and prompt_set["made"] == 4
    # Held-out chat prompts come from held-out documents only.
    splits = document_splits([{"kind": "stdlib"}])
    documents = [p["key"].removeprefix("chat:embedded:").rsplit(":", 1)[0] for p in prompt_set["prompts"]]
    assert all(splits[d] == "heldout" for d in documents)
    rows = [json.loads(line) for line in (tmp_path / "heldout" / "outputs.jsonl").read_text().splitlines()]
    assert all(r["prompt"].startswith(("Write the Python module", "Complete this function")) for r in rows)


@pytest.mark.parametrize("layout", ["sharegpt", "openai"])
def test_eval_acceptance_takes_a_chat_file_in_either_layout(chat_run, micro_target_dir, tmp_path, monkeypatch, layout):
    tmp, _ = chat_run
    asks = ["Write a function that reverses a list.", "Write a class for a 2D point."]
    if layout == "sharegpt":
        rows = [{"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": "..."}]} for a in asks]
    else:
        rows = [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": "..."}]} for a in asks]
    path = tmp_path / f"{layout}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = _cli(
        monkeypatch,
        f"drafter={tmp / 'run' / 'drafter'}",
        f"target={micro_target_dir}",
        f"prompts={path}",
        "max_new_tokens=8",
        f"paths.output_dir={tmp_path / 'file'}",
    )
    assert res["lossless"] is True and res["num_prompts"] == 2
    outputs = [json.loads(line) for line in (tmp_path / "file" / "outputs.jsonl").read_text().splitlines()]
    assert [o["prompt"] for o in outputs] == asks
    # The prompts went through the template the drafter was trained with (its record), not raw text.
    record = load_drafter(tmp / "run" / "drafter").config.training_data
    tok = AutoTokenizer.from_pretrained(micro_target_dir)
    ids = [p.ids for p in load_prompts(str(path), tok, training_data=record)]
    assert ids == [render_prompt([{"role": "user", "content": a}], tok, "plain") for a in asks]
