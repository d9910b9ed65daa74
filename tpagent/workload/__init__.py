"""Workloads in namespaces of their own (``tpagent launch``), and the records that vouch for them.

* :mod:`~tpagent.workload.launch` -- start a command as the init of a new PID and mount
  namespace (so its PIDs never collide where it is restored) and keep a root-only record of it
  (:func:`~tpagent.workload.launch.launched`): a workload is known by that record, never by its
  command line.
* :mod:`~tpagent.workload.nsinit` -- that init: it opens the workload's stdio inside the
  namespace, forwards signals, reaps orphans, and exits with the workload's status.

Contract: a launched workload is dumpable by CRIU as a whole namespace; nothing here knows of
migrations or of moving jobs (an init whose workload is a rank only reports its exit to the
agent, in the rank protocol's words).  Below every other part of the agent.
"""
