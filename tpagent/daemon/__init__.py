"""The node agent (``tpagent serve``): one process per node that runs the other parts.

* :mod:`~tpagent.daemon.node` -- :class:`~tpagent.daemon.node.Node`, the registry of what runs
  here (migrations as source and as target, rewires) and the dispatcher of every call to the
  module of its concern; it decides nothing itself.
* :mod:`~tpagent.daemon.service` -- the gRPC servicer, a thin adapter over ``Node``;
  :mod:`~tpagent.daemon.client` -- another agent as a :class:`~tpagent.migration.api.Peer`;
  :mod:`~tpagent.daemon.rpc` -- mutual TLS and signed calls (the one importer of the generated
  code of :mod:`~tpagent.daemon.proto`).
* :mod:`~tpagent.daemon.serve` -- wiring, signals, shutdown;
  :mod:`~tpagent.daemon.doctor` -- can this node checkpoint?

The top of the agent: nothing but the CLI imports it.
"""
