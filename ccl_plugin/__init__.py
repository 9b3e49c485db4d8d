"""In-process CCL counters (Aegis CL/WR/WC) and the NCCL profiler plugin.

Imported inside training processes: standard library (and torch, already there)
only, cheap to import, and it never raises into user code.
"""
