"""Distributed jobs: the ranks of ``torch.distributed`` jobs on this node, and moving ranks with
their job rewired (every rank stops at one step boundary, tears its communicators down, the
moving ranks migrate, all build new ones) so that the job goes on from the same step.

The rank protocol (the agent's requests to a rank's runtime, and a stand-in's to the agent) is
typed once, in :mod:`tpagent_rank.protocol`, which both sides import.

* :mod:`~tpagent.jobs.ranks` -- the ranks of this node: the abstract socket they reach their
  agent on, who is believed (``SO_PEERCRED`` against a stand-in's registration), what is known
  of each (kept across restarts).
* :mod:`~tpagent.jobs.rewire` -- moving ranks of a running job; its phases and their table.
* :mod:`~tpagent.jobs.standin` -- ``tpagent rank``: what a job's launcher starts and watches
  in a rank's place, wherever the rank runs.

Built on :mod:`tpagent.migration` (each moving rank migrates by the ordinary protocol, its copy
held until the job's new communicators are up).
"""
