"""compose_train: the training config as train.py composes it, also from inside another Hydra app."""

from hydra import initialize
from hydra.core.global_hydra import GlobalHydra

from dflash2.train_config import compose_train


def test_composes_the_experiment_as_train_py_does():
    GlobalHydra.instance().clear()
    cfg = compose_train(["experiment=drafter_small", "drafter.block_size=16"])
    assert cfg.target.name == "small" and cfg.drafter.num_hidden_layers == 3 and cfg.drafter.block_size == 16
    assert not GlobalHydra.instance().is_initialized()  # nothing left behind outside an app


def test_the_callers_hydra_is_put_back():
    """eval.speedup composes the training config from inside its own Hydra app: the app's instance survives."""
    GlobalHydra.instance().clear()
    with initialize(version_base="1.3", config_path=None):
        outer = GlobalHydra.instance().hydra
        assert compose_train(["experiment=drafter_small"]).target.name == "small"
        assert GlobalHydra.instance().hydra is outer
    GlobalHydra.instance().clear()
