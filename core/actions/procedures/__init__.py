"""What an agent carries out once a plan is confirmed: one module per action kind.

Each procedure runs in a worker thread of the agent's service, reports its
steps through ``report`` (each becomes an audit record and a progress event)
and returns an :data:`Outcome`: the final state, the message a person reads
and detail lines. It does only what the agent was configured to do
(``--actions-config``), on the targets of the plan just confirmed; nothing a
client wrote is ever run.

- :mod:`.evict`: stop this machine's ranks and block it, or have a scheduler
  backend evict it;
- :mod:`.update`: switch the code link for a hot-update or rollback, and
  apply a pending lazy update when its window expires or the job restarts;
- :mod:`.backup`: ask the ranks for a checkpoint backup and verify the shards.
"""

from __future__ import annotations

from collections.abc import Callable

from rankscope.actions.model import ActionState

Report = Callable[[str], None]  # one progress line of a running action
Outcome = tuple[ActionState, str, tuple[str, ...]]  # final state, message, details
