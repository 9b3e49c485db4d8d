"""Between machines: the node agent, the client that asks every agent at once, and what they share.

``agent`` is the gRPC server on each machine (``rank_progress`` is its memory
of the job between readings), ``client`` the one way the TUI, the CLI and the
drill reach agents, ``proto`` the generated code and ``proto_convert`` the one
converter between it and the contract; ``tls`` and ``tokens`` authenticate
both ends; ``agents_spec`` and ``slurm`` say which agents to contact (lists,
hostfiles, agents started inside a Slurm allocation).
"""
