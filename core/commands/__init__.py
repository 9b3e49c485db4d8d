"""One module per CLI verb; see rankscope.cli for the conventions."""
