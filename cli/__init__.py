"""The ``tpagent`` command line (typer): thin commands over the typed layers."""
