"""Data-parallel training without a trainer (issue 15, item 5): the step sampler's rank slices, the
anchors of a row at any world size, the loss normalisation over ranks (two gloo processes), and the
checks that refuse the paths that would export or report a wrong model.

The whole run through `train.py` in 1 and 2 processes: tests/test_multi_process_train.py."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from dflash2.drafter.objective import (
    block_metric_sums,
    metrics_from_sums,
    own_weight_total,
    row_anchor_generator,
    sample_anchors,
    weighted_block_loss,
)
from dflash2.errors import DFlash2Error
from dflash2.training.drafter_data import KeyedRows, StepSampler, collate_keyed_sequences

WORLDS = (1, 2, 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------- the step sampler


@pytest.mark.parametrize("batch_size", [4, 6])  # 6: W = 4 does not divide it, ranks get 1 or 2 rows
def test_rank_slices_are_the_global_batch_at_any_world_size(batch_size):
    steps, n = 8, 10  # the stream crosses epochs of the data (and a batch straddles one at batch_size 6)
    one = list(StepSampler(n, batch_size, steps, seed=5))
    for world in WORLDS:
        ranks = [list(StepSampler(n, batch_size, steps, seed=5, rank=r, world_size=world)) for r in range(world)]
        assert all(len(r) == steps for r in ranks)  # every rank takes every step: no rank's epoch ends early
        for step in range(steps):
            union = [key for r in range(world) for key in ranks[r][step]]  # rank order = row order
            assert union == one[step], (world, step)
            assert [key.row for key in union] == list(range(batch_size))  # disjoint, nothing lost
            assert {len(ranks[r][step]) for r in range(world)} <= {batch_size // world, -(-batch_size // world)}
        # resumed at step 3 in another world size: the same remaining global batches
        resumed = [
            list(StepSampler(n, batch_size, steps, seed=5, start_step=3, rank=r, world_size=world))
            for r in range(world)
        ]
        assert [[k for r in range(world) for k in resumed[r][i]] for i in range(steps - 3)] == one[3:]


def test_with_gradient_accumulation_a_step_is_a_micro_batch_and_resumes_after_whole_optimizer_steps():
    from dflash2.training.drafter_data import DrafterDataModule

    data = DrafterDataModule(_rows(), [], batch_size=4, total_steps=5, seed=0, pad_id=0)
    data.trainer = SimpleNamespace(accumulate_grad_batches=3, global_step=2, global_rank=1, world_size=2)
    sampler = data.train_dataloader().batch_sampler
    assert (sampler.start_step, sampler.total_steps, len(sampler)) == (6, 15, 9)  # 2 optimizer steps = 6 batches
    first = next(iter(sampler))
    assert [(key.step, key.row) for key in first] == [(6, 2), (6, 3)]  # rank 1's half of batch 6


def test_a_global_batch_smaller_than_the_world_is_a_one_line_error():
    with pytest.raises(DFlash2Error, match=r"data.batch_size=2 is the global batch .* raise data.batch_size to >= 4"):
        StepSampler(10, 2, 3, seed=0, rank=0, world_size=4)


def _rows(count: int = 13) -> list[dict]:
    """Rows of different lengths and supervised spans, as regenerated data has."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count):
        length = int(torch.randint(20, 40, (1,), generator=g))
        prompt = int(torch.randint(3, 10, (1,), generator=g))
        ids = torch.randint(3, 50, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt), "prompt_len": prompt})
    return rows


def test_a_row_draws_the_same_anchors_at_any_world_size():
    rows, batch_size, steps = _rows(), 6, 5
    drawn, padded = {}, {}
    for world in WORLDS:
        drawn[world], padded[world] = {}, {}
        for rank in range(world):
            sampler = StepSampler(len(rows), batch_size, steps, seed=1, rank=rank, world_size=world)
            loader = DataLoader(
                KeyedRows(rows), batch_sampler=sampler, collate_fn=lambda b: collate_keyed_sequences(b, 0)
            )
            for batch in loader:
                keys = [tuple(k) for k in batch["anchor_keys"].tolist()]
                anchors, valid = sample_anchors(
                    batch["loss_mask"], 4, [row_anchor_generator(1, step, row) for step, row in keys]
                )
                for i, key in enumerate(keys):
                    drawn[world][key] = anchors[i][valid[i]].tolist()
                    padded[world][key] = batch["input_ids"].shape[1]
    assert len(drawn[1]) == batch_size * steps
    assert drawn[2] == drawn[1] and drawn[4] == drawn[1]
    # ... though the rows were padded to other lengths in other batch company (the draw must not see padding)
    assert any(padded[4][key] != padded[1][key] for key in padded[1])
    assert len({tuple(a) for a in drawn[1].values()}) > batch_size  # and rows do draw different anchors


# ----------------------------------------------------------------- the loss over ranks (2 gloo processes)


def _problem():
    """A global batch of 5 rows (ranks hold 2 and 3: unequal rows and unequal label weights), the
    rows' features, and the weight of a linear head shared by the ranks (what DDP synchronises)."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(5, 3, 7, 8, generator=g)
    head = torch.randn(8, 11, generator=g)
    labels = torch.randint(0, 11, (5, 3, 7), generator=g)
    mask = torch.rand(5, 3, 7, generator=g) < torch.linspace(0.2, 0.9, 5).view(5, 1, 1)
    weights = torch.exp(-torch.arange(7.0) / 4.0)
    return features, head, labels, mask, weights


class _Head(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, features):
        return features @ self.weight


def _rank_grads(rank: int, init_file: str, out_file: str) -> None:
    from datetime import timedelta

    from torch.nn.parallel import DistributedDataParallel

    from dflash2.training.data_parallel import all_reduce_sum, global_weight_share

    # A file rendezvous, not a TCP port: inside the full suite a port picked free can be taken by the
    # time rank 0 binds it, and a rank then waits forever; the timeout turns any hang into an error.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    try:
        features, head, labels, mask, weights = _problem()
        rows = slice(0, 2) if rank == 0 else slice(2, 5)
        results = {}
        for name, total in (("global", global_weight_share), ("per_rank_mean", own_weight_total)):
            model = DistributedDataParallel(_Head(head))
            logits = model(features[rows])
            loss = weighted_block_loss(logits, labels[rows], mask[rows], weights, total)
            loss.backward()  # DDP averages the gradient over the two ranks
            results[name] = (model.module.weight.grad.clone(), all_reduce_sum(loss.detach()) / 2)
        predictions = (features[rows] @ head).argmax(-1)
        results["metrics"] = all_reduce_sum(block_metric_sums(predictions, labels[rows], mask[rows]))
        # the ranks are separate interpreters (_run_two_ranks): results go through a file each
        final = out_file if rank == 0 else f"{out_file}.rank{rank}"
        torch.save(results, f"{final}.tmp")  # then renamed: the runner takes an existing file as complete
        os.replace(f"{final}.tmp", final)
    finally:
        dist.destroy_process_group()


def _run_two_ranks(init_file: str, out_file: str, limit_s: float = 240.0) -> None:
    """_rank_grads in two fresh interpreters (plain subprocesses, not mp.spawn: inside the full suite a
    spawned rank hung now and then, asleep with its peer gone, and nothing said where). Each rank gets
    the parent's environment without any launcher's rank variables, one thread, and a faulthandler that
    prints every thread's stack and exits if it is still running after limit_s: a hang fails the test
    with the stacks in its message instead of stalling the suite."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC")}
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), env.get("PYTHONPATH", "")])
    )
    # os._exit after the work: in the full suite a rank that had finished every collective (its peer saved
    # the results and exited 0) once hung for minutes with no Python frame left, in interpreter shutdown
    # (gloo / FileStore teardown), and under a loaded CPU one hung again with only the one-line script on its
    # stack, i.e. in that last exit. So a rank's verdict is its results file (written after its last
    # collective), not its exit: a rank still running once both files exist is given a grace period and then
    # killed. A rank that stops or hangs before its results are written still fails the test.
    code = (
        "import faulthandler, os, sys, torch; faulthandler.dump_traceback_later(float(sys.argv[4]), exit=True); "
        "torch.set_num_threads(1); from test_data_parallel import _rank_grads; "
        "_rank_grads(int(sys.argv[1]), sys.argv[2], sys.argv[3]); sys.stdout.flush(); os._exit(0)"
    )
    results = [Path(out_file), Path(f"{out_file}.rank1")]
    log_files = [Path(f"{out_file}.log{rank}") for rank in (0, 1)]
    procs = []
    for rank in (0, 1):
        with open(log_files[rank], "w") as log:  # a file, not a pipe: no rank can block on a full pipe
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, str(rank), init_file, out_file, str(limit_s)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline, grace_s, done_at = time.monotonic() + limit_s + 30, 20.0, None
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if done_at is None and all(f.exists() for f in results):
            done_at = time.monotonic()
        if done_at is not None and time.monotonic() - done_at > grace_s:
            break  # both ranks' work is on disk: a rank still alive is stuck in its exit
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    failed = [r for r, (p, f) in enumerate(zip(procs, results)) if not f.exists() or (p.returncode not in (0, -9))]
    if failed:
        pytest.fail(
            "a gloo rank failed:\n"
            + "\n".join(
                f"--- rank {r} (exit {procs[r].returncode}, results {'written' if results[r].exists() else 'missing'})"
                f"\n{log_files[r].read_text()[-4000:]}"
                for r in failed
            )
        )


def test_two_ranks_reproduce_the_one_process_loss_and_gradient_of_the_global_batch(tmp_path):
    features, head, labels, mask, weights = _problem()
    model = _Head(head)
    loss = weighted_block_loss(model(features), labels, mask, weights)
    loss.backward()
    out_file = tmp_path / "rank0.pt"
    _run_two_ranks(str(tmp_path / "rendezvous"), str(out_file))
    out = torch.load(out_file, weights_only=True)
    grad, ddp_loss = out["global"]
    other = torch.load(f"{out_file}.rank1", weights_only=True)  # DDP leaves both ranks the same gradient
    assert torch.equal(other["global"][0], grad) and torch.equal(other["global"][1], ddp_loss)
    # One process sums the 5 rows in one reduction, the ranks 2 + 3 rows and then over ranks: fp32 rounding only.
    torch.testing.assert_close(ddp_loss, loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, model.weight.grad, rtol=1e-5, atol=1e-8)
    # What DDP gives when each rank normalises by its own weights: another loss and another gradient.
    naive_grad, naive_loss = out["per_rank_mean"]
    assert abs(float(naive_loss) - float(loss.detach())) > 1e-3
    assert not torch.allclose(naive_grad, model.weight.grad, rtol=1e-2)
    whole = metrics_from_sums(block_metric_sums((features @ head).argmax(-1), labels, mask))
    torch.testing.assert_close(metrics_from_sums(out["metrics"])["acc_per_position"], whole["acc_per_position"])


# ----------------------------------------------------------------- refused paths


@pytest.mark.parametrize("strategy", ["ddp_spawn", "deepspeed"])
def test_strategies_that_could_report_another_model_are_refused(strategy):
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    from dflash2.training.full_drafter import check_supported_strategy

    if strategy == "ddp_spawn":
        ddp = DDPStrategy(start_method="spawn")
        ddp._launcher = _MultiProcessingLauncher(ddp, start_method="spawn")
    else:
        ddp = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # its constructor needs the deepspeed package
        ddp._launcher = None
    with pytest.raises(DFlash2Error, match="is not supported: dflash2 trains on one device, with DDP"):
        check_supported_strategy(SimpleNamespace(strategy=ddp))


def test_the_fsdp_copy_holds_the_gathered_weights_on_rank_zero_only(make_spec_target, make_spec_drafter):
    """Logic check of the FSDP path with a stand-in for the gather (FSDP needs GPUs; not an FSDP run)."""
    from lightning.pytorch.strategies import FSDPStrategy

    from dflash2.drafter.local_conv import set_conv_kernels
    from dflash2.drafter.model import set_norm_kernels
    from dflash2.training.full_drafter import drafter_on_rank_zero

    drafter = make_spec_drafter(make_spec_target("qwen3"), 4, v2=True)
    full = {f"drafter.{k}": v + 1.0 for k, v in drafter.state_dict().items()}  # what the shards gather to
    switched = [m for m in drafter.modules() if hasattr(m, "use_kernels")]
    assert switched  # the v2 drafter has RMSNorms and block-local convs
    set_norm_kernels(drafter, True)
    set_conv_kernels(drafter, True)

    class Gathering(FSDPStrategy):
        def lightning_module_state_dict(self):
            return full if self.rank == 0 else {}

    for rank in (0, 1):
        strategy = Gathering()
        strategy.rank = rank
        trainer = SimpleNamespace(strategy=strategy, is_global_zero=rank == 0)
        copy = drafter_on_rank_zero(trainer, SimpleNamespace(drafter=drafter))
        if rank:
            assert copy is None
            continue
        assert copy is not drafter and type(copy) is type(drafter)
        for k, v in copy.state_dict().items():
            assert torch.equal(v, full[f"drafter.{k}"]), k
        assert all(m.use_kernels for m in copy.modules() if hasattr(m, "use_kernels"))  # the training's code path
    full.pop(next(iter(full)))  # a missing weight is an error, never a partly fresh drafter
    strategy = Gathering()
    strategy.rank = 0
    with pytest.raises(RuntimeError, match="Missing key"):
        drafter_on_rank_zero(SimpleNamespace(strategy=strategy, is_global_zero=True), SimpleNamespace(drafter=drafter))


def test_weight_decay_groups_survive_fsdp_flattening(make_spec_target, make_spec_drafter):
    from dflash2.training.drafter_module import DrafterTrainingModule

    target = make_spec_target("qwen3")
    drafter = make_spec_drafter(target, 4, v2=True)
    matrices = sum(p.ndim >= 2 for p in drafter.parameters())
    module = DrafterTrainingModule(
        drafter, target, num_anchors=2, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.1,
        warmup_ratio=0.0, total_steps=1, seed=0,
    )  # fmt: skip
    with torch.no_grad():
        for p in drafter.parameters():  # what FSDP's sharded views look like: 1-D
            p.data = p.data.flatten()
    groups = module.configure_optimizers()["optimizer"].param_groups
    decayed = [p for g in groups if g["weight_decay"] == 0.1 for p in g["params"]]
    assert len(decayed) == matrices and all(g["weight_decay"] in (0.0, 0.1) for g in groups)
    assert sum(len(g["params"]) for g in groups) == sum(1 for _ in drafter.parameters())


def test_fsdp_clips_the_norm_over_all_shards_through_its_root(make_spec_target, make_spec_drafter):
    """Lightning's FSDP precision plugin refuses norm clipping; the root's clip_grad_norm_ takes it over the
    shards (logic check with a stand-in root, not an FSDP run)."""
    from lightning.pytorch.strategies import FSDPStrategy

    from dflash2.training.drafter_module import DrafterTrainingModule

    target = make_spec_target("qwen3")
    module = DrafterTrainingModule(
        make_spec_drafter(target, 4), target, num_anchors=2, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3,
        weight_decay=0.0, warmup_ratio=0.0, total_steps=1, seed=0,
    )  # fmt: skip
    calls = []
    strategy = FSDPStrategy()
    strategy.model = SimpleNamespace(clip_grad_norm_=calls.append)
    module._trainer = SimpleNamespace(strategy=strategy)
    module.configure_gradient_clipping(None, 1.0, "norm")
    assert calls == [1.0]
    with pytest.raises(DFlash2Error, match="use norm clipping"):
        module.configure_gradient_clipping(None, 1.0, "value")


# ----------------------------------------------------------------- torchrun / SLURM: what must be ready first


def test_launchers_that_start_every_rank_at_once_are_told_to_prepare_first(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from dflash2.data.regenerate import regenerate_split
    from dflash2.training.build_target import ensure_target
    from dflash2.training.cli import one_folder_problem, rank_job_overrides
    from dflash2.training.launch import PREPARE_FIRST, external_rank, external_world_size

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "RANK", "WORLD_SIZE"):  # as when run by hand or CI
        monkeypatch.delenv(name, raising=False)
    assert external_world_size() == 1 and rank_job_overrides([]) == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert (external_world_size(), external_rank()) == (2, 1)
    assert rank_job_overrides(["a=1"]) == ["hydra.job.name=train_rank1", "hydra.output_subdir=null"]
    assert rank_job_overrides(["hydra.job.name=mine"]) == []

    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert (external_world_size(), external_rank()) == (4, 3)
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # Lightning's rule: srun is not the launcher then
    assert (external_world_size(), external_rank()) == (1, 0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")

    dated = OmegaConf.create({"paths": {"output_dir": "outputs/${now:%H-%M-%S}"}})
    assert "set paths.output_dir=DIR" in one_folder_problem(dated, [])
    assert one_folder_problem(dated, ['hydra.run.dir="/x"']) is None  # one folder for every rank
    assert one_folder_problem(OmegaConf.create({"paths": {"output_dir": "/runs/a"}}), []) is None

    cfg = OmegaConf.create(
        {"target": {"path": None, "name": "tiny", "recipe": {"x": 1}}, "paths": {"cache_dir": str(tmp_path)}}
    )
    monkeypatch.setattr("dflash2.training.build_target.target_cache_key", lambda cfg: "key")
    with pytest.raises(DFlash2Error, match=r"target is not built yet .*python train.py task=data"):
        ensure_target(cfg)
    tokenizer = SimpleNamespace(chat_template=None, eos_token_id=0, pad_token_id=0)
    monkeypatch.setattr("dflash2.data.regenerate.regeneration_cache_key", lambda *a, **k: "key")
    with pytest.raises(DFlash2Error, match="train data is not in the cache") as err:
        regenerate_split(
            SimpleNamespace(tokenizer=tokenizer), {"sampling": "greedy"}, split="train", num_prompts=4, seed=0,
            cache_dir=tmp_path, target_id="t", missing_hint=PREPARE_FIRST,
        )  # fmt: skip
    assert PREPARE_FIRST in str(err.value) and not (tmp_path / "data").exists()
