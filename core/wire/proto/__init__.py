"""Generated gRPC code for the agent protocol (source: rankscope.proto).

Only ``rankscope.wire.agent``, ``rankscope.wire.client`` and ``rankscope.wire.proto_convert``
import this package; everything else speaks the snapshot contract. The
generated modules are committed and checked by tests/integration/test_proto.py; rebuild
them with ``python -m rankscope.wire.proto.generate``.
"""
