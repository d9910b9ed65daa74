"""The orchestrator: moves the ranks of jobs off tainted nodes and GPUs without a person, and back.

Agents report to it (:mod:`tpagent.daemon.report`); an operator, an Alertmanager alert or a GPU's
health taints a node or a GPU; the policy (:mod:`.policy`, a pure function of what it knows) picks a
spare for every job's ranks there; each move is written down (:mod:`.state`, SQLite) before it is
asked of the source agent, which runs it as ``tpagent migrate --job`` would and stays the authority
on it.  Its contract is :mod:`.api`.
"""
