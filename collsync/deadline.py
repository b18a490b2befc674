"""The run's default deadline, in a module that imports nothing.

`collsync.policy` holds every other default of a sync policy, but it loads torch (its rules do): the start-up
watchdog of `collsync-train` (`collsync.runtime.startup`) is armed with this value before torch is imported, so
that a rank's own imports count against MPI's start-up no more than they must (`collsync.cli._check_world`).
"""

from __future__ import annotations

# The longest a server waits for any gradient at all (and, at the end, for a worker to stop) before it stops the run
# naming the workers it waits for, and the longest MPI's start-up and the start-up exchange wait for every rank:
# finite by default, so a stopped or dead worker never hangs a job for ever. None (`sync.deadline=null`) waits for
# ever, when asked for.
DEADLINE = 600.0
