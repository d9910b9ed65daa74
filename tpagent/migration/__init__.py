"""The two-agent migration protocol: a process moves from a source node to a target node with
nothing lost on any failure (the original runs on where it stood, or its copy runs on the target).

Its contract is :mod:`tpagent.migration.api`: the source's and the target's states and their
transition tables, how a migration ends (:class:`~tpagent.migration.api.MigrationResult`), the
error family, and :class:`~tpagent.migration.api.Peer`, what one agent needs from the other.
The rest is written against it and against :class:`~tpagent.migration.context.Context` (what
the protocol needs of the agent it runs in), never against gRPC:

* :mod:`~tpagent.migration.journal` -- every step written down first (a versioned format);
* :mod:`~tpagent.migration.source`, :mod:`~tpagent.migration.target` -- the protocol's two ends;
* :mod:`~tpagent.migration.decide` -- how a source decides with its target once a copy may exist;
* :mod:`~tpagent.migration.resolve` -- ending a source migration after a restart, or on an
  operator's word;
* :mod:`~tpagent.migration.eligible` -- what this node may migrate;
* :mod:`~tpagent.migration.admission` -- what a target checks and reserves per migration it takes;
  :mod:`~tpagent.migration.receivers` -- the migrations this node receives;
* :mod:`~tpagent.migration.watch` -- what the agent's metrics show of them.
"""
