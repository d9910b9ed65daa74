"""What the tests share, imported as ``support.<module>`` (tests/ is on sys.path: pytest puts
the root conftest's directory there, and the benches put it there themselves).

  * ``helpers``: the repository's root, workloads started and stopped, polling with a deadline;
  * ``certs``: a cluster CA and node certificates (scripts/make-certs.sh);
  * ``cluster``, ``cluster_fixtures``: network namespaces as nodes, each running an agent;
  * ``agents``: agents on this machine's loopback, without namespaces;
  * ``rankjob``: torch jobs whose ranks run under ``tpagent rank`` on those nodes;
  * ``proxy``: a TCP proxy on loopback, for fault injection;
  * ``transfer_support``: snapshot-shaped directories, a receiver in a thread, a send;
  * ``protocol_fakes``: an in-memory target agent and a held dump for the migration protocol;
  * ``fake_cuda``: the CUDA driver's checkpoint calls, recorded.

The scripts the tests run as processes are not here: tests/workloads/ (what is dumped, moved and
trained) and tests/attackers/ (what attacks an agent or a receiver, as user nobody)."""
