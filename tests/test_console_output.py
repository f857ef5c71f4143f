"""What a run prints (issue 10): each line once, concise, rank 0 only, user errors on one line."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager

import pytest
from conftest import REPO, subprocess_env
from hydra import compose, initialize, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash2.eval.acceptance_cli import CONFIG_NAME as EVAL_CONFIG
from dflash2.eval.acceptance_cli import register_configs
from dflash2.logging_setup import (
    ConsoleFormatter,
    RankZeroFilter,
    configure_console_logging,
    send_lightning_logs_to_root,
)
from dflash2.training.cli import CONFIG_DIR


def record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_console_lines_name_the_package_and_only_warnings_name_the_level():
    fmt = ConsoleFormatter()
    assert fmt.format(record("dflash2.training.run", logging.INFO, "target: /x")) == "[dflash2] target: /x"
    assert (
        fmt.format(record("lightning.pytorch.utilities.rank_zero", logging.INFO, "GPU available: False"))
        == "[lightning] GPU available: False"
    )
    assert (
        fmt.format(record("dflash2.eval.acceptance", logging.WARNING, "skipping prompt 1"))
        == "[dflash2] WARNING: skipping prompt 1"
    )


@pytest.mark.parametrize(
    "env,shown",
    [
        ({}, True),
        ({"RANK": "0"}, True),
        ({"LOCAL_RANK": "1"}, False),
        ({"RANK": "3"}, False),
        ({"SLURM_PROCID": "2"}, False),
    ],
)
def test_console_lines_come_from_rank_zero_only(monkeypatch, env, shown):
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert RankZeroFilter().filter(record("dflash2", logging.INFO, "x")) is shown


@contextmanager
def bare_logging():
    """The root logger and Lightning's loggers as a plain script has them (no handlers), restored after.
    Entered in the test body: pytest adds its capture handlers to the root logger after fixtures run."""
    names = ("", "lightning", "lightning.pytorch", "lightning.fabric")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate) for n in names}
    saved_level = logging.getLogger().level
    for n in names:
        logging.getLogger(n).handlers[:] = []
    try:
        yield
    finally:
        for n, (handlers, propagate) in saved.items():
            logging.getLogger(n).handlers[:] = handlers
            logging.getLogger(n).propagate = propagate
        logging.getLogger().setLevel(saved_level)


def test_cli_logging_prints_each_line_once_and_keeps_lightning_lines(capsys):
    with bare_logging():
        lightning_own = logging.StreamHandler(sys.stdout)  # what `import lightning` installs
        logging.getLogger("lightning").addHandler(lightning_own)
        send_lightning_logs_to_root()  # no root handler yet: Lightning's own is the only way its lines show
        assert logging.getLogger("lightning").handlers == [lightning_own]

        configure_console_logging()
        configure_console_logging()  # a second call adds nothing
        assert len(logging.getLogger().handlers) == 1 and not logging.getLogger("lightning").handlers
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
        logging.getLogger("dflash2.export").info("exported drafter to /x")
        logging.getLogger("dflash2.export").debug("not shown at INFO")
    assert capsys.readouterr().out.splitlines() == [
        "[lightning] GPU available: False, used: False",
        "[dflash2] exported drafter to /x",
    ]


def assert_concise_job_logging(cfg):
    job_logging = cfg.hydra.job_logging
    assert job_logging.formatters.console["()"] == "dflash2.logging_setup.ConsoleFormatter"
    assert job_logging.handlers.console.filters == ["rank_zero"]
    assert job_logging.root.handlers == ["console", "file"]


def test_train_and_eval_configs_use_the_concise_job_logging(tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        assert_concise_job_logging(compose("train", [f"paths.output_dir={tmp_path}"], return_hydra_config=True))
    GlobalHydra.instance().clear()
    register_configs()  # as `python -m eval.acceptance` does: the eval config is found in Hydra's ConfigStore
    with initialize(version_base="1.3", config_path=None):
        assert_concise_job_logging(compose(EVAL_CONFIG, ["drafter=x"], return_hydra_config=True))
    GlobalHydra.instance().clear()


@pytest.mark.slow
def test_a_train_run_prints_each_line_once(tmp_path, micro_train_overrides):
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "train.py", *micro_train_overrides, "debug=fast_dev_run", f"paths.output_dir={run}"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout.splitlines() + out.stderr.splitlines()
    counts = Counter(console)
    lightning = [line for line in console if line.startswith("[lightning] ")]
    assert "[lightning] GPU available: False, used: False" in lightning
    assert "[lightning] TPU available: False, using: 0 TPU cores" in lightning
    assert any(line.startswith("[lightning] Running in `fast_dev_run` mode") for line in lightning)
    assert all(counts[line] == 1 for line in lightning), lightning
    # Lightning's own handler ("INFO: ...") and Hydra's default format ("[date][module][INFO] - ...") are gone.
    assert not [line for line in console if line.startswith("INFO: ") or "][INFO] - " in line]
    summary = [
        f"[dflash2] target: {run / 'target'}",
        f"[dflash2] drafter saved to {run / 'drafter'}",
        f"[dflash2] done; everything is under {run} (run_summary.json)",
    ]
    assert all(counts[line] == 1 for line in summary), [(line, counts[line]) for line in summary]
    # the result (measured τ) once, then the estimate and the accuracies it comes from, labelled, once each
    starts = (
        "[dflash2] RESULT: measured tau = ",
        "[dflash2]   estimate, not a decode: tau ~ ",
        "[dflash2]   held-out per-position top-1 accuracy",
    )
    for start in starts:
        assert sum(line.startswith(start) for line in console) == 1, start
    [result] = [i for i, line in enumerate(console) if line.startswith(starts[0])]
    assert console[result + 1].startswith(starts[1]) and console[result + 2].startswith(starts[2])  # in this order

    # The log file in the run folder holds the same records with time, logger and level.
    [log_file] = run.glob("*.log")
    logged = log_file.read_text().splitlines()
    assert (
        sum(
            line.endswith("[dflash2.training.run][INFO] - done; everything is under " + f"{run} (run_summary.json)")
            for line in logged
        )
        == 1
    )
    assert sum(line.endswith("][INFO] - GPU available: False, used: False") for line in logged) == 1


@pytest.mark.slow
def test_a_user_error_is_one_line_on_stderr(tmp_path, micro_train_overrides):
    out = subprocess.run(
        [sys.executable, "train.py", *micro_train_overrides, "drafter.hidden_size=48", f"paths.output_dir={tmp_path}"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "hidden size" in errors[0], out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == errors[0] and "Traceback" not in out.stderr
