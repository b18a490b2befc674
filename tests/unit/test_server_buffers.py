"""The server's hot path allocates nothing: the in-place `Rule.update_` it runs on its own buffer is bit for bit the
pure `update` (which leaves its inputs alone), a server stepping in place ends where one stepping purely does, and
`Server.holds` says when a received gradient's buffer may take the next receive."""

from __future__ import annotations

import pytest
import torch

from collsync.policy import asynchronous, bsp, ssp
from collsync.rules.base import Rule, chain
from collsync.rules.fasgd import fasgd
from collsync.rules.optim import momentum, nesterov, sgd
from collsync.server import Server
from collsync.types import Arrival, Context

RULES = {
    "sgd": lambda: sgd(lr=0.1),
    "sgd_wd": lambda: sgd(lr=0.1, weight_decay=1e-3, milestones=[3], lr_decay=0.5),
    "momentum": lambda: momentum(lr=0.05, momentum=0.9, weight_decay=5e-4),
    "nesterov": lambda: nesterov(lr=0.05, momentum=0.9, warmup=4),
    "chain": lambda: chain(sgd(lr=0.1), momentum(lr=1.0, momentum=0.5)),
}


@pytest.mark.parametrize("name", RULES)
def test_update_in_place_is_the_pure_update_bit_for_bit(name):
    rule: Rule = RULES[name]()
    assert rule.update_ is not None
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(257, generator=gen, dtype=torch.float64)
    pure_state = rule.init(params)
    own_state = rule.init(params)
    for step in range(6):
        g = torch.randn(257, generator=gen, dtype=torch.float64)
        ctx = Context(step=step, worker=0, staleness=step % 3)
        kept = g.clone()
        before = [t.clone() for t in _tensors(pure_state)]
        out, pure_state_next = rule.update(g, pure_state, params, ctx)
        assert torch.equal(g, kept)  # the pure update leaves its gradient alone ...
        assert all(torch.equal(a, b) for a, b in zip(before, _tensors(pure_state), strict=True))  # ... and state
        buf = g.clone()
        out_, own_state = rule.update_(buf, own_state, params, ctx)
        assert out_.data_ptr() == buf.data_ptr()  # written over the server's buffer: nothing allocated for it
        assert torch.equal(out, out_)
        assert all(torch.equal(a, b) for a, b in zip(_tensors(pure_state_next), _tensors(own_state), strict=True))
        pure_state = pure_state_next
        params = params + out


@pytest.mark.parametrize("policy", [asynchronous(), bsp()], ids=["async", "bsp"])
@pytest.mark.parametrize("name", ["sgd_wd", "nesterov"])
def test_a_server_stepping_in_place_ends_where_a_pure_one_does(name, policy):
    gen = torch.Generator().manual_seed(1)
    params = torch.randn(100, generator=gen)
    rule = RULES[name]()
    servers = [Server(params, rule, policy, 3), Server(params, rule._replace(update_=None), policy, 3)]
    for step in range(12):
        for w in range(3):
            g = torch.randn(100, generator=gen)
            for s in servers:
                version = s.version if policy.rounds else max(0, s.version - w)
                s.accept(Arrival(w, version, g.clone(), s.version if policy.rounds else step))
    assert servers[0].version == servers[1].version > 0
    assert torch.equal(servers[0].params, servers[1].params)
    for a, b in zip(_tensors(servers[0].opt_state), _tensors(servers[1].opt_state), strict=True):
        assert torch.equal(a, b)


def test_holds_a_gradient_only_while_an_update_still_needs_it():
    params = torch.zeros(4)
    server = Server(params, sgd(lr=0.1), bsp(), 2)
    g0, g1 = torch.ones(4), torch.ones(4)
    server.accept(Arrival(0, 0, g0, 0))
    assert server.holds(g0)  # buffered until the round is complete
    server.accept(Arrival(1, 0, g1, 0))
    assert server.version == 1 and not server.holds(g0) and not server.holds(g1)
    assert not server.holds(None)
    lead = Server(params, sgd(lr=0.1), ssp(max_lead=2), 2)
    ahead = torch.ones(4)
    lead.accept(Arrival(0, 0, torch.ones(4), 0))
    lead.accept(Arrival(0, 0, ahead, 1))  # worker 0 one round ahead: kept for round 1
    assert lead.holds(ahead)


def test_holds_the_last_gradient_bfasgd_reapplies():
    server = Server(torch.zeros(4), fasgd(lr=0.1), asynchronous(c_push=1.0, c_fetch=1.0), 2)
    g = torch.ones(4)
    server.accept(Arrival(0, 0, g, 0))
    assert server.version == 1 and server.holds(g)  # re-applied when worker 0 skips its next push


def _tensors(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, tuple):
        return [t for x in state for t in _tensors(x)]
    return []
