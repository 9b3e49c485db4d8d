"""rankscope: live inspection of hung and slow distributed training jobs.

This root package holds what every role shares: the snapshot contract, the
bundle format, errors that carry their fix, and the command line. It must
stay cheap to import: analyzers and the in-process CCL plugin import it.
"""

__version__ = "0.1.0"
