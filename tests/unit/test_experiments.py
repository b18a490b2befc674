"""The paper recipes (conf/experiment/): each composes and passes the schema, and its own values win over
config.yaml's defaults and over a sync policy's default optimizer (the defaults list puts experiment last)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from collsync import schema
from collsync.cli import CONF_DIR


def composed(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    schema.check(cfg)
    return cfg


def test_barkai_c4_sets_app_c4() -> None:
    cfg = composed("sync=async", "method=ga", "experiment=barkai_c4")
    assert cfg.optimizer._target_ == "collsync.rules.nesterov" and cfg.penalty._target_ == "collsync.rules.gap_aware"
    assert (cfg.optimizer.lr, cfg.optimizer.momentum, cfg.optimizer.weight_decay) == (0.1, 0.9, 0.0005)
    assert list(cfg.optimizer.milestones) == [300, 450] and cfg.optimizer.lr_decay == 0.1  # 50% / 75% of 600
    assert (cfg.steps, cfg.batch_size, cfg.warmup_updates) == (600, 16, 18)
    assert cfg.model._target_ == "collsync.models.cnn" and cfg.data.shift == 1 and not cfg.data.flatten
    # A command-line value still wins over the recipe.
    assert composed("sync=async", "experiment=barkai_c4", "steps=400").steps == 400


def test_chen_sync_sets_rmsprop_and_ema_even_under_async() -> None:
    for sync in ("backup", "async"):
        cfg = composed(f"sync={sync}", "experiment=chen_sync")
        assert cfg.optimizer._target_ == "collsync.rules.rmsprop"
        assert (cfg.optimizer.decay, cfg.optimizer.momentum, cfg.optimizer.eps) == (0.9, 0.9, 1.0)
        assert cfg.ema_decay == 0.99 and cfg.batch_size == 16


def test_odena_fasgd_counts_tau_as_its_code_for_both_methods() -> None:
    assert composed("sync=async", "method=fasgd", "experiment=odena_fasgd").optimizer.tau == "boxes"
    assert composed("sync=async", "method=sasgd", "experiment=odena_fasgd").penalty.tau == "boxes"
