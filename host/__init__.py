"""The host floor: what root does on this node on a user's behalf, with nothing of snapshots in it.

* :mod:`host.api` -- the contract: the error family (:class:`~host.api.UsageError`: the request
  cannot be carried out as asked), which the snapshot layer takes for its own.
* :mod:`host.paths` -- every path on disk the agent and the CLI use, in one place.
* :mod:`host.safefs` -- paths root reads or writes for someone else: private directories, no
  symlink followed, no directory another user could change, private secret files.
* :mod:`host.proc` -- processes: trees, namespaces, start times, signals, deferred Ctrl-C.
* :mod:`host.userdirs` -- what root binds or removes in directories users can reach: the way to
  a unix socket CRIU binds as root; removing only that very file.
* :mod:`host.sockets` -- a tree's sockets: TCP endpoints, unix sockets and their directories.
* :mod:`host.gpus` -- the GPUs (NVML): inventory, which process uses which, pairing by bus id.
* :mod:`host.hushed` -- warnings a flood may repeat (refused connections), said once a second.

It imports nothing of tpagent's other packages, but the stdlib-only rank protocol
(:mod:`tpagent_rank.protocol`) for the one path both of its sides share, and only when asked.
"""
