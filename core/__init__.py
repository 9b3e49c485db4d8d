"""rankscope: live inspection of hung and slow distributed training jobs.

The subpackages follow the data path (docs/architecture.md): ``contract``
(the snapshot types, errors, bundles) and ``formats`` (readers of saved
dumps and traces into it), ``wire`` (agent, client, proto, auth), ``actions``,
``drill`` and ``cli``; probes, analyzers, the CCL plugin and the TUI are
installed beside them. This root must stay cheap to import: analyzers and
the in-process CCL plugin import it.
"""

__version__ = "0.1.0"
