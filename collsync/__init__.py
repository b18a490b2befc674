"""collsync: straggler-tolerant and asynchronous data-parallel training for PyTorch over MPI.

The public faces: `collsync.torch` (a Horovod-compatible API for your own training script: `import collsync.torch
as hvd`), the `collsync-train` / `collsync-report` commands, and the algorithm core below (update rules in the optax
style, sync policies, the parameter server), which the simulator and every MPI runtime share.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("collsync")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "policy", "rules", "server", "torch"]
