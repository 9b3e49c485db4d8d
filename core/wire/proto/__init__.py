"""Generated gRPC code for the agent protocol (source: rankscope.proto).

Only ``rankscope.wire`` (the agent, the client and the codec modules: ``codec``,
``compact``, ``delta``, ``snapshot_codec``, ``action_messages``) imports this package; everything else speaks the snapshot contract. The
generated modules are committed and checked by tests/integration/test_proto.py; rebuild
them with ``python -m rankscope.wire.proto.generate``.
"""
