"""A target build that fla's GDN backward would refuse on this GPU stops before any work, with the remedy
(dflash2/training/fla_backward_check.py). fla is not installed on the CPU machines: a stand-in package
with fla's three flags is put on sys.path, and torch is told a GPU is present."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from dflash2.training.fla_backward_check import fla_backward_refusal

BROKEN = {"IS_NVIDIA_HOPPER": True, "TRITON_ABOVE_3_4_0": True, "TRITON_ABOVE_3_7_1": False}


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    """Install a stand-in `fla` whose `fla.utils` holds the given flags (None: the flags are absent)."""

    def install(flags: dict | None, *, tilelang: bool = False):
        for name in ("fla", "fla.utils", "tilelang"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        package = tmp_path / "fla"
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
        lines = [f"{k} = {v}" for k, v in (flags or {}).items()]
        (package / "utils.py").write_text(textwrap.dedent("\n".join(lines)) + "\n")
        if tilelang:
            (tmp_path / "tilelang.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    yield install
    for name in ("fla", "fla.utils", "tilelang"):
        sys.modules.pop(name, None)


def test_hopper_with_a_triton_fla_refuses_is_refused_with_the_remedies(fake_fla):
    import triton

    fake_fla(BROKEN)
    reason = fla_backward_refusal("gpu")
    assert reason is not None
    assert f"triton {triton.__version__}" in reason
    for remedy in ("pip uninstall -y flash-linear-attention fla-core", ">= 3.7.1", "tilelang"):
        assert remedy in reason
    assert "\n" not in reason


@pytest.mark.parametrize(
    "flags",
    [
        {**BROKEN, "IS_NVIDIA_HOPPER": False},  # an A100 or a Blackwell GPU
        {**BROKEN, "TRITON_ABOVE_3_7_1": True},  # the fixed triton
        {**BROKEN, "TRITON_ABOVE_3_4_0": False},  # a triton older than the bug
        None,  # a fla release without these flags is trusted
    ],
)
def test_other_gpus_tritons_and_fla_releases_are_let_through(fake_fla, flags):
    fake_fla(flags)
    assert fla_backward_refusal("gpu") is None


def test_tilelang_installed_lets_fla_dispatch_the_kernel_there(fake_fla):
    fake_fla(BROKEN, tilelang=True)
    assert fla_backward_refusal("gpu") is None


def test_a_cpu_build_is_not_checked(fake_fla):
    fake_fla(BROKEN)
    assert fla_backward_refusal("cpu") is None


def test_without_fla_nothing_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` fails, find_spec raises ValueError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fla_backward_refusal("gpu") is None


def test_the_target_build_stops_before_reading_the_corpus(fake_fla, tmp_path, monkeypatch):
    """ensure_target on a (pretended) GPU raises DFlash2Error before any corpus is read or folder made."""
    from conftest import MICRO_TARGET_OVERRIDES
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import dflash2.training.build_target as build_target
    from dflash2.errors import DFlash2Error
    from dflash2.training.cli import CONFIG_DIR

    fake_fla(BROKEN)

    def no_corpus(*args, **kwargs):
        raise AssertionError("the corpus was read before the check")

    monkeypatch.setattr(build_target, "load_documents", no_corpus)
    overrides = [*MICRO_TARGET_OVERRIDES, "trainer.accelerator=gpu", f"paths.cache_dir={tmp_path / 'cache'}"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"paths.output_dir={tmp_path / 'run'}"])
    GlobalHydra.instance().clear()
    with pytest.raises(DFlash2Error, match="fla issue #640"):
        build_target.ensure_target(cfg)
    assert not list((tmp_path / "cache").rglob("*.build"))
