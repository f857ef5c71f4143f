"""`python -m dflash2.data.features_bench`: bytes per token and read speed of one feature shard,
safetensors (the format of ``feature_shards``) against a `datasets` Arrow dataset (issue 15).

Both hold the same rows: ``--rows`` sequences of ``--tokens`` tokens, each token ``--taps`` x
``--hidden`` bf16 features plus an int32 next-token id. Arrow has no bf16 type, so it stores them
either as fp32 (lossless, twice the bytes) or as their raw bits in uint16 (same bytes, but the dtype
is no longer in the file). Read speed: every row once in a random order, as a training epoch reads
them into a torch tensor, after the files were written (so from the page cache: the format's overhead,
not the disk's).
Prints a Markdown table; numbers of one machine go into docs/TRAINING.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dflash2.data.feature_shards import FeatureManifest, FeatureStore, save_shard


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def bench_safetensors(taps: torch.Tensor, next_ids: torch.Tensor, folder: Path, order: list[int]) -> tuple[int, float]:
    """taps (n, L, F) bf16, next_ids (n, L) int32 -> (bytes on disk, seconds to read every row)."""
    n, length, width = taps.shape
    save_shard(
        folder,
        0,
        {
            "rows": torch.arange(n),
            "offsets": torch.arange(n + 1) * length,
            "taps": taps.reshape(n * length, width),
            "next_ids": next_ids.reshape(-1),
        },
    )
    manifest = FeatureManifest("x", "x", "bfloat16", list(range(1)), width, 0, "bench", n, n)
    store = FeatureStore(folder, manifest)
    start = time.perf_counter()
    for row in order:
        store.taps(row).clone()  # a copy of every value, as the collate's into the padded batch
    return folder_bytes(folder), time.perf_counter() - start


def bench_arrow(taps: torch.Tensor, next_ids: torch.Tensor, folder: Path, order: list[int], bits: bool):
    """The same rows as a `datasets` dataset; ``bits``: bf16 as uint16 bits, else as fp32."""
    import datasets

    _, length, width = taps.shape
    stored = taps.view(torch.int16).numpy().view(np.uint16) if bits else taps.float().numpy()
    features = datasets.Features(
        {
            "taps": datasets.Array2D(shape=(length, width), dtype="uint16" if bits else "float32"),
            "next_ids": datasets.Sequence(datasets.Value("int32")),
        }
    )
    ds = datasets.Dataset.from_dict({"taps": list(stored), "next_ids": next_ids.tolist()}, features=features)
    ds.save_to_disk(str(folder))
    ds = datasets.load_from_disk(str(folder)).with_format("numpy")
    start = time.perf_counter()
    for row in order:
        value = torch.from_numpy(np.asarray(ds[row]["taps"]))
        (value.view(torch.int16).view(torch.bfloat16) if bits else value).clone()
    return folder_bytes(folder), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash2.data.features_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="sequences in the shard")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--taps", type=int, default=5, help="K tapped layers")
    parser.add_argument("--hidden", type=int, default=4096, help="d of the target (4096: an 8B Qwen3)")
    a = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(a.rows, a.tokens, a.taps * a.hidden, generator=g).to(torch.bfloat16)
    next_ids = torch.randint(0, 150_000, (a.rows, a.tokens), generator=g, dtype=torch.int32)
    order = torch.randperm(a.rows, generator=g).tolist()
    tokens = a.rows * a.tokens
    raw = a.taps * a.hidden * 2 + 4  # bf16 features + int32 id: the payload per token
    print(f"{a.rows} rows x {a.tokens} tokens, {a.taps} x {a.hidden} bf16 features ({raw} payload bytes/token)\n")
    print("| format | bytes/token | x payload | read, tokens/s | read, MB/s |")
    print("|---|---:|---:|---:|---:|")
    cases = [
        ("safetensors (bf16)", lambda d: bench_safetensors(taps, next_ids, d, order)),
        ("Arrow, datasets (fp32)", lambda d: bench_arrow(taps, next_ids, d, order, bits=False)),
        ("Arrow, datasets (bf16 bits as uint16)", lambda d: bench_arrow(taps, next_ids, d, order, bits=True)),
    ]
    for name, case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            size, seconds = case(Path(tmp) / "f")
        per_token = size / tokens
        print(
            f"| {name} | {per_token:,.0f} | {per_token / raw:.2f} | {tokens / seconds:,.0f} | "
            f"{size / seconds / 1e6:,.0f} |"
        )


if __name__ == "__main__":
    main()
