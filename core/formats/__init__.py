"""Readers of outside formats into the contract, for jobs no agent watched (``rankscope analyze``).

``pyspy_dir`` reads saved py-spy dumps, ``flight_recorder`` PyTorch flight
recorder dumps, ``optrace_io`` per-operation timing traces; each hands the
pure analyzers contract types or plain rows and turns bad input into a
``RankscopeError`` naming the fix. ``sniff`` tells which of them a path holds.
"""
