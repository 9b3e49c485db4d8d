"""Between machines: the node agent, the client that asks every agent at once, and what they share.

``agent`` is the gRPC server on each machine (``rank_progress`` is its memory
of the job between readings), ``client`` the one way the TUI, the CLI and the
drill reach agents, ``proto`` the generated code; ``codec`` the one converter
between it and the contract, ``compact`` the per-machine tables a reading
travels in, ``delta`` what a reply leaves out as unchanged (the agent's and the
client's side), ``snapshot_codec`` the entry for a reading and
``action_messages`` for the action protocol; ``target`` the agents a command
reaches; ``tls`` and ``tokens`` authenticate
both ends; ``agents_spec`` and ``slurm`` say which agents to contact (lists,
hostfiles, agents started inside a Slurm allocation); ``sync_loop`` the one event
loop on which synchronous callers (scripts, the drill) make their calls.
"""
