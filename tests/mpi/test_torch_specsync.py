"""SpecSync's parts of collsync.torch in a world without servers (any size): `speculative` changes nothing under
other modes, so a script may keep it whatever it runs; SpecSync itself asks for server ranks at init()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import collsync.torch as hvd


@pytest.fixture(scope="module", autouse=True)
def world():
    hvd.init()
    yield
    hvd.shutdown()


def train(wrap: str, steps: int = 3) -> tuple[list[torch.Tensor], torch.optim.Optimizer, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync="bsp")
    calls = 0

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for t in range(steps):
        g = torch.Generator().manual_seed(100 * t + hvd.rank())
        x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
        if wrap == "hvd":
            out = hvd.speculative(step)(x, y)
        elif wrap == "opt":
            out = opt.speculative(step, x, y)
        else:
            out = step(x, y)
        assert isinstance(out, float)  # the step's own return value comes back
    opt.close()
    return [p.detach().clone() for p in model.parameters()], opt, calls


def test_speculative_is_a_plain_call_under_other_modes():
    plain, _, _ = train("none")
    for wrap in ("hvd", "opt"):
        params, opt, calls = train(wrap)
        assert calls == 3  # once per step: nothing aborts outside SpecSync
        assert all(torch.equal(a, b) for a, b in zip(params, plain, strict=True))
        assert opt.aborted is False and opt.specsync is None and opt.version is None


def test_specsync_without_reserved_servers_says_how():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"init\(sync='specsync'\)") as info:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync="specsync")
    assert "\n" not in str(info.value)
