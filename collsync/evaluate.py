"""The test-set evaluation of a run: accuracy and loss of theta and of its EMA (000_... §1.1:
theta_bar <- alpha * theta_bar + (1 - alpha) * theta), recorded into the trace, with the divergence guard."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from collsync.data import Dataset
from collsync.flat import FlatModel
from collsync.server import Diverged, Server
from collsync.trace import Trace

if TYPE_CHECKING:
    from tqdm import tqdm

Assemble = Callable[[Server], tuple[torch.Tensor, torch.Tensor | None]]


class Evaluator:
    """Test accuracy of theta and of its EMA every `every` updates (and at the end), into the trace.

    `assemble(server)` gives the full (params, ema) to evaluate when the server holds one shard of them; with
    `final_later`, the evaluation at the end is left to the caller (`evaluate_at`), once every shard has finished.
    `guard_loss`: stop (`Diverged`) once the test loss is non-finite or above this many times the first one measured.
    """

    def __init__(
        self,
        flat: FlatModel,
        data: Dataset,
        trace: Trace,
        every: int,
        progress: tqdm | None = None,
        assemble: Assemble | None = None,
        final_later: bool = False,
        guard_loss: float | None = None,
    ) -> None:
        self.flat, self.data, self.trace, self.every, self.progress = flat, data, trace, every, progress
        self.assemble, self.final_later = assemble, final_later
        self.guard_loss: float | None = guard_loss
        self.first_loss: float | None = None

    def accuracy(self, params: torch.Tensor) -> tuple[float, float]:
        self.flat.load(params)
        with torch.no_grad():
            logits = self.flat.module(self.data.x_test)
            loss = torch.nn.functional.cross_entropy(logits, self.data.y_test).item()
            acc = (logits.argmax(1) == self.data.y_test).float().mean().item()
        return acc, loss

    def __call__(self, server: Server) -> None:
        """The server's `on_update`: evaluate at version 0, every `every` versions and at the end."""
        if self.progress is not None:
            self.progress.update(server.version - self.progress.n)
        if server.version % self.every and not server.done and server.version:
            return
        if server.done and self.final_later:
            return
        params, ema = self.assemble(server) if self.assemble is not None else (server.params, server.ema)
        self.evaluate_at(server.version, params, ema)

    def evaluate_at(self, version: int, params: torch.Tensor, ema: torch.Tensor | None) -> None:
        """Evaluate `params` (and `ema`) as the model at server `version`; record it; apply the guard."""
        acc, loss = self.accuracy(params)
        fields: dict[str, float] = {"acc": acc, "loss": loss}
        if ema is not None:
            fields["ema_acc"], fields["ema_loss"] = self.accuracy(ema)
        self.trace.record("eval", version=version, **fields)
        if self.progress is not None:
            self.progress.set_postfix(acc=f"{acc:.3f}")
        if self.guard_loss is not None:
            self.first_loss = loss if self.first_loss is None else self.first_loss
            if not math.isfinite(loss) or loss > self.guard_loss * self.first_loss:
                raise Diverged(
                    f"guard: the test loss is {loss:.4g} at server step {version}, its start was {self.first_loss:.4g} "
                    f"(guard_loss={self.guard_loss}: stop above that many times the start); lower optimizer.lr, or "
                    "add warm-up or a penalty"
                )
