"""Node-side collectors: rank discovery, py-spy stacks, host and GPU metrics, CCL counter files.

Never imports textual: a training node installs only `rankscope[agent]`.
"""
