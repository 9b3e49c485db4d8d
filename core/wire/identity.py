"""A machine's name as its agent reports it: one that no other agent on the host reports, stable across restarts."""

from __future__ import annotations

from collections.abc import Sequence

from rankscope.contract.snapshot import RankInfo


def container_id(cgroup_text: str) -> str | None:
    """The container's id (12 hex digits) from /proc/self/cgroup text, or None outside a container."""
    import re

    found = re.search(r"(?:docker|containerd|cri-containerd|crio|libpod)[-/]([0-9a-f]{64})", cgroup_text)
    return found.group(1)[:12] if found else None


def machine_identity(hostname: str, ranks: Sequence[RankInfo], container: str | None, port: int) -> str:
    """A machine name that no other agent on this host reports, and that survives a restart of the agent.

    Several agents can share a host (containers with the host's network,
    tests, one agent per torchrun node of a job spread over one big host);
    the hostname alone would merge them into one machine for every per-machine
    detector. In order: the torchrun node rank its ranks share (stable across
    restarts of the agent and of the job), the container's id, the port it
    listens on (stable when given with --port).
    """
    nodes = {r.group_rank for r in ranks if r.group_rank is not None}
    if len(nodes) == 1:
        return f"{hostname}-node{nodes.pop()}"
    if container is not None and container not in hostname:
        return f"{hostname}-{container}"
    if container is not None:
        return hostname  # a container's own hostname is its id already
    return f"{hostname}-{port}"
