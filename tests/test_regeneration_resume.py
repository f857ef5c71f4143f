"""Crash safety of regeneration (issue 6): a regeneration subprocess SIGKILLed after k batches
leaves its finished batches in the partial folder; a rerun resumes there and writes the dataset
an uninterrupted run writes, row for row, greedy and sampled. Unreadable shards are regenerated."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env

from dflash2.data import regenerate
from dflash2.target import TargetModel

REPO = Path(__file__).resolve().parents[1]
DATA = {
    "sources": [{"kind": "stdlib"}],
    "validation_fraction": 0.02,
    "heldout_fraction": 0.02,
    "prompt_min_tokens": 8,
    "prompt_max_tokens": 16,
    "response_tokens": 16,
    "sampling": "greedy",
    "temperature": 1.0,
    "generation_batch_size": 4,
}
NUM_PROMPTS, NUM_BATCHES, KILL_AFTER = 24, 6, 3  # killed when asked for batch 3, after shards 0-2 were saved
SEED, LAYERS = 0, [0, 1, 2]

# The child regenerates the train split and SIGKILLs itself when asked for batch KILL_AFTER: by then
# batches 0..KILL_AFTER-1 were generated and their shards saved, and nothing else was written.
CHILD = """
import json, os, signal, sys
import torch
torch.set_num_threads(1)
from dflash2.data import regenerate
from dflash2.target import TargetModel

target_dir, cache_dir, data, kill_after, num_prompts, seed, layers = sys.argv[1:]
real, calls = regenerate.generate_responses, []

def generate_or_die(*args, **kwargs):
    if len(calls) == int(kill_after):
        os.kill(os.getpid(), signal.SIGKILL)
    calls.append(1)
    return real(*args, **kwargs)

regenerate.generate_responses = generate_or_die
target = TargetModel.from_pretrained(target_dir, target_layer_ids=json.loads(layers), dtype="float32")
regenerate.regenerate_split(target, json.loads(data), split="train", num_prompts=int(num_prompts), seed=int(seed),
                            cache_dir=cache_dir, target_id=target_dir)
print("the child was not killed")
"""


class Recorder:
    """Wraps `generate_responses` and records each batch it generates: (prompt (n, P), response (n, R))."""

    def __init__(self, fail_at: int = -1):
        self.real, self.fail_at, self.calls = regenerate.generate_responses, fail_at, []

    def __call__(self, target, prompt_ids, **kwargs):
        if len(self.calls) == self.fail_at:
            raise InterruptedError("simulated interruption")
        response = self.real(target, prompt_ids, **kwargs)
        self.calls.append((prompt_ids.clone(), response))
        return response


def regenerate_recorded(target, target_dir, cache: Path, data: dict, recorder: Recorder):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(regenerate, "generate_responses", recorder)
        return regenerate.regenerate_split(
            target, data, split="train", num_prompts=NUM_PROMPTS, seed=SEED, cache_dir=cache, target_id=str(target_dir)
        )


@pytest.fixture(scope="module")
def micro_target(micro_target_dir):
    return TargetModel.from_pretrained(str(micro_target_dir), target_layer_ids=LAYERS, dtype="float32")


@pytest.fixture(scope="module")
def reference(micro_target, micro_target_dir, tmp_path_factory):
    """sampling -> (dataset, recorded batches, cache folder) of an uninterrupted run, made once."""
    made = {}

    def get(sampling: str):
        if sampling not in made:
            cache, recorder = tmp_path_factory.mktemp(f"reference_{sampling}"), Recorder()
            dataset = regenerate_recorded(
                micro_target, micro_target_dir, cache, {**DATA, "sampling": sampling}, recorder
            )
            assert len(recorder.calls) == NUM_BATCHES and len(dataset) == NUM_PROMPTS
            made[sampling] = (dataset, recorder.calls, cache)
        return made[sampling]

    return get


def launch_child(target_dir: Path, cache: Path, data: dict, log: Path) -> subprocess.Popen:
    env = subprocess_env()
    args = [
        str(target_dir),
        str(cache),
        json.dumps(data),
        str(KILL_AFTER),
        str(NUM_PROMPTS),
        str(SEED),
        json.dumps(LAYERS),
    ]
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT
    )


def assert_same_rows(dataset, expected) -> None:
    assert dataset.features == expected.features
    assert dataset.to_dict() == expected.to_dict()  # every column, row for row, in order


def assert_generated_only(recorder: Recorder, reference_calls: list, first: int) -> None:
    """The rerun generated exactly the batches first..end, with the reference's prompts and responses."""
    assert len(recorder.calls) == NUM_BATCHES - first
    for (prompt, response), (ref_prompt, ref_response) in zip(recorder.calls, reference_calls[first:]):
        assert torch.equal(prompt, ref_prompt) and torch.equal(response, ref_response)


def partial_folder(cache: Path) -> Path:
    (folder,) = (cache / "data").glob(".train-*.partial")
    return folder


@pytest.fixture(scope="module")
def killed_caches(micro_target_dir, reference, tmp_path_factory):
    """sampling -> (cache folder, child's return code, its log) of a child SIGKILLed after batch 3 of 6.

    Both children run at once and the references are made meanwhile: most of a child's time is imports.
    """
    root = tmp_path_factory.mktemp("killed")
    procs = {
        s: launch_child(micro_target_dir, root / s, {**DATA, "sampling": s}, root / f"{s}.log")
        for s in ("greedy", "sample")
    }
    try:
        for sampling in procs:
            reference(sampling)
        for proc in procs.values():
            proc.wait(timeout=180)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {s: (root / s, proc.returncode, (root / f"{s}.log").read_text()) for s, proc in procs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["greedy", "sample"])
def test_sigkilled_regeneration_resumes_from_its_shards_to_the_same_dataset(
    sampling, micro_target_dir, micro_target, reference, killed_caches, caplog
):
    data = {**DATA, "sampling": sampling}
    expected, reference_calls, reference_cache = reference(sampling)
    cache, returncode, log = killed_caches[sampling]
    assert returncode == -signal.SIGKILL, log[-3000:]

    # Killed after batch 3 of 6: no final dataset (nor its temp folder), three complete shards and no temp file.
    partial = partial_folder(cache)
    assert os.listdir(cache / "data") == [partial.name]
    assert sorted(os.listdir(partial)) == [f"batch-{i:06d}.pt" for i in range(KILL_AFTER)]

    if sampling == "sample":
        # The check below has teeth: batch 3 sampled from a freshly seeded generator differs from the
        # reference, so equal rows after the resume mean the saved generator state was restored.
        fresh = regenerate.generate_responses(
            micro_target,
            reference_calls[KILL_AFTER][0],
            max_new_tokens=DATA["response_tokens"],
            eos_token_id=micro_target.tokenizer.eos_token_id,
            pad_token_id=micro_target.tokenizer.pad_token_id,
            sample=True,
            temperature=1.0,
            generator=torch.Generator().manual_seed(SEED),
        )
        assert not torch.equal(fresh, reference_calls[KILL_AFTER][1])

    caplog.set_level(logging.INFO, logger="dflash2")
    recorder = Recorder()
    dataset = regenerate_recorded(micro_target, micro_target_dir, cache, data, recorder)
    assert f"regeneration of train: resuming at batch {KILL_AFTER}/{NUM_BATCHES} from {partial}" in caplog.messages
    assert_generated_only(recorder, reference_calls, KILL_AFTER)
    assert_same_rows(dataset, expected)
    # Same final folder name as the uninterrupted run, and the partial folder is gone.
    assert (
        os.listdir(cache / "data")
        == os.listdir(reference_cache / "data")
        == [partial.name[1:].removesuffix(".partial")]
    )


@pytest.mark.slow
def test_a_truncated_shard_is_discarded_and_regenerated(tmp_path, micro_target_dir, micro_target, reference, caplog):
    cache, data = tmp_path / "cache", {**DATA, "sampling": "sample"}
    expected, reference_calls, _ = reference("sample")
    with pytest.raises(InterruptedError):  # interrupted when asked for batch 3: shards 0-2 saved
        regenerate_recorded(micro_target, micro_target_dir, cache, data, Recorder(fail_at=KILL_AFTER))
    partial = partial_folder(cache)
    shard = partial / "batch-000001.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn write
    stray = partial / f".batch-000003.pt.tmp-{os.getpid()}"  # a killed write's temp file
    stray.write_bytes(b"half a shard")

    caplog.set_level(logging.INFO, logger="dflash2")
    recorder = Recorder()
    dataset = regenerate_recorded(micro_target, micro_target_dir, cache, data, recorder)
    assert any(
        r.levelno == logging.WARNING and r.getMessage().startswith(f"discarding unreadable regeneration shard {shard} ")
        for r in caplog.records
    )
    assert f"regeneration of train: resuming at batch 1/{NUM_BATCHES} from {partial}" in caplog.messages
    # Batch 1 and every later one (their generator state follows from batch 1) were generated again.
    assert_generated_only(recorder, reference_calls, 1)
    assert_same_rows(dataset, expected)
    assert not partial.exists()
