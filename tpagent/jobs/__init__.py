"""Distributed jobs: the ranks of ``torch.distributed`` jobs on this node, and moving ranks with
their job rewired (every rank stops at one step boundary, tears its communicators down, the
moving ranks migrate, all build new ones) so that the job goes on from the same step.

Its contract is :mod:`tpagent.jobs.api`: a rewire's phases and their transition table, its
record, how it fails, and the Protocols it is built from.  The rank protocol (what the agent
asks a rank's runtime, and what stand-ins and agents ask an agent about a rank) is typed once,
in :mod:`tpagent_rank.protocol`, which both sides import.

* :mod:`~tpagent.jobs.ranks` -- the ranks of this node: the abstract socket they reach their
  agent on, who is believed (the peer's pidfd against a stand-in's registration), what is known
  of each (kept across restarts); :mod:`~tpagent.jobs.door` -- every connection until it is a
  rank's (one thread, bounded); :mod:`~tpagent.jobs.connection` -- one rank's connection;
* :mod:`~tpagent.jobs.calls` -- one ``Rank`` call: passed on to the rank, or answered here;
* :mod:`~tpagent.jobs.rewire` -- moving ranks of a running job, phase by phase;
  :mod:`~tpagent.jobs.moves` -- asking every rank at once, and each moving rank's migration;
* :mod:`~tpagent.jobs.journal` -- where each rewire stands, written before each phase;
  :mod:`~tpagent.jobs.rewires` -- the rewires an agent runs, finished after its restart;
* :mod:`~tpagent.jobs.standin` -- ``tpagent rank``: what a job's launcher starts and watches
  in a rank's place, wherever the rank runs.

Built on :mod:`tpagent.migration` (each moving rank migrates by the ordinary protocol, its copy
held until the job's new communicators are up).
"""
