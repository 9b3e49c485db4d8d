"""The ``rankscope`` command: ``main`` parses and dispatches, one module per verb under ``commands``."""
