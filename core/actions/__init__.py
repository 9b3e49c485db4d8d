"""One-key actions: eviction, hot-update, checkpoint backup and rollback (ByteRobust §6).

The data of the protocol lives in :mod:`rankscope.actions.model`; the
persistent state an agent keeps (audit log, blocklist, hot-update history) in
``audit``, ``blocklist`` and ``history``; the eviction backends in
``evict_backends`` and code-version switching in ``hot_update``. Nothing here
imports grpc or textual: the agent and the TUI wire these in.
"""
