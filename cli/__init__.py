"""The ``tpagent`` command line (typer): thin commands over the typed layers."""

import os

# gRPC's C core writes its own INFO lines to stderr (a TLS handshake that failed, as it happens)
# unless told otherwise before it loads; a failure is said once, in tpagent's sentence.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
