"""Regenerated data is cached under a key of the target's identity: other weights, other key (issue 6)."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from dflash2.data.regenerate import _content_digest, target_fingerprint


def test_same_architecture_with_other_weights_gets_another_fingerprint(micro_target_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(micro_target_dir, copy)
    assert target_fingerprint(copy) == target_fingerprint(micro_target_dir)  # the path does not matter, the contents do

    weights = load_file(copy / "model.safetensors")
    save_file(
        {k: v + 1 if v.is_floating_point() else v for k, v in weights.items()},
        copy / "model.safetensors",
        metadata={"format": "pt"},
    )
    assert (copy / "model.safetensors").stat().st_size == (micro_target_dir / "model.safetensors").stat().st_size
    assert target_fingerprint(copy) != target_fingerprint(micro_target_dir)
    assert target_fingerprint("Qwen/Qwen3-8B") == "hub:Qwen/Qwen3-8B"


def test_large_files_are_hashed_from_sampled_chunks_that_still_see_a_change(tmp_path):
    path = tmp_path / "big.bin"
    data = bytearray(torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes())
    path.write_bytes(bytes(data))
    sampled = _content_digest(path, full_below=1 << 20, samples=64, sample_bytes=4096)
    assert sampled != _content_digest(path)  # the sampled digest really took the sampled path
    # new weights past the header (what a training step does to a checkpoint) change the digest
    data[(1 << 20) :] = bytes((b + 1) % 256 for b in data[(1 << 20) :])
    path.write_bytes(bytes(data))
    assert _content_digest(path, full_below=1 << 20, samples=64, sample_bytes=4096) != sampled
