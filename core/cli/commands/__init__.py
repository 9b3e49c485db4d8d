"""One module per CLI verb; see rankscope.cli.main for the conventions."""
