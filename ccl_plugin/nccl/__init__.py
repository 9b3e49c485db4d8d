"""C sources of the NCCL profiler plugin (built by ``rankscope.ccl_plugin.build``)."""
