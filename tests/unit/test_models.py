"""Seeded models: shapes, bit-identical weights for a seed, no global RNG, input checks."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from collsync import models
from collsync.models import cnn, mlp

CONF = Path(__file__).resolve().parents[2] / "conf"


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_mlp_shapes_and_layers():
    net = mlp((64,), 10, hidden=[32, 16])
    assert net(torch.zeros(5, 64)).shape == (5, 10)
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 16), (16, 10)]
    assert mlp((1, 8, 8), 10)(torch.zeros(3, 1, 8, 8)).shape == (3, 10)  # flattens images
    assert mlp((20,), 4, hidden=[])(torch.zeros(2, 20)).shape == (2, 4)  # logistic regression
    assert mlp((20,), 4, hidden=OmegaConf.create([8]))(torch.zeros(2, 20)).shape == (2, 4)  # as Hydra passes it


@pytest.mark.parametrize(
    ("shape", "channels"), [((1, 8, 8), [16, 32]), ((3, 32, 32), [8, 8, 8]), ((1, 28, 28), [4]), ((2, 3, 5), [4, 4])]
)
def test_cnn_shapes(shape, channels):
    net = cnn(shape, 10, channels=channels, hidden=12)
    assert net(torch.zeros(2, *shape)).shape == (2, 10)


@pytest.mark.parametrize("factory", [mlp, cnn])
def test_same_seed_same_weights_whatever_the_global_rng(factory):
    shape = (1, 8, 8)
    torch.manual_seed(1)
    a = factory(shape, 10, seed=3)
    torch.manual_seed(2)
    b = factory(shape, 10, seed=3)
    assert _same(a, b)
    assert not _same(a, factory(shape, 10, seed=4))
    assert all(p.dtype == torch.float32 for p in a.parameters())
    # Building a model leaves the caller's random stream alone.
    torch.manual_seed(5)
    before = torch.get_rng_state()
    factory(shape, 10, seed=3)
    assert torch.equal(torch.get_rng_state(), before)


def test_models_are_float32_under_another_default_dtype():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        a, b = mlp((4,), 3, seed=0), cnn((1, 8, 8), 3, seed=0)
    finally:
        torch.set_default_dtype(old)
    assert all(p.dtype == torch.float32 for p in [*a.parameters(), *b.parameters()])
    assert _same(a, mlp((4,), 3, seed=0))


def test_bad_inputs_are_named():
    with pytest.raises(
        ValueError, match=r"cnn: input_shape=\(64,\) must be \(C, H, W\): load image data with data.flatten=false"
    ):
        cnn((64,), 10)
    with pytest.raises(ValueError, match="mlp: classes=1 must be >= 2"):
        mlp((4,), 1)
    with pytest.raises(ValueError, match=r"mlp: hidden=\[8, 0\] must hold positive widths"):
        mlp((4,), 3, hidden=[8, 0])
    with pytest.raises(ValueError, match=r"mlp: input_shape=\(\) must be non-empty"):
        mlp((), 3)
    with pytest.raises(ValueError, match=r"cnn: channels=\[\] must hold at least one"):
        cnn((1, 8, 8), 3, channels=[])
    with pytest.raises(ValueError, match="cnn: hidden=0 must be >= 1"):
        cnn((1, 8, 8), 3, hidden=0)


@pytest.mark.parametrize(("option", "shape"), [("mlp", (64,)), ("cnn", (1, 8, 8))])
def test_model_configs_are_partial_factories(option, shape):
    cfg = OmegaConf.load(CONF / "model" / f"{option}.yaml")
    assert cfg._target_ == f"collsync.models.{option}" and cfg._partial_ is True
    params = inspect.signature(getattr(models, option)).parameters
    for key, value in OmegaConf.to_container(cfg).items():
        if key not in ("_target_", "_partial_"):
            default = params[key].default
            assert value == (list(default) if isinstance(default, tuple) else default)
    net = instantiate(cfg)(input_shape=shape, classes=10, seed=0)
    assert _same(net, getattr(models, option)(shape, 10, seed=0))
