"""What every part of the agent shares, and nothing of any one protocol.

* :mod:`~tpagent.common.config` -- :class:`~tpagent.common.config.AgentConfig` (a TOML file,
  then ``TPAGENT_*``), and :class:`~tpagent.common.config.Timeouts`, every wait of the agent,
  checked against each other at load.
* :mod:`~tpagent.common.credentials` -- the cluster secret and this node's TLS files, checked
  root's and private.
* :mod:`~tpagent.common.clock` -- the agent's wall clock and the skew allowed between nodes.
* :mod:`~tpagent.common.threads` -- owned background threads, and how they stop.
* :mod:`~tpagent.common.metrics` -- the Prometheus metrics.
"""
