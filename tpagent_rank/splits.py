"""torch's ``split_group`` of a delegating group (:mod:`tpagent_rank.backend`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tpagent_rank.backend import DelegatingGroup


def split_group(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch's ``split_group`` (what a DeviceMesh calls once the default group is bound to a
    GPU) of a delegating group: the subgroup of this rank made by ``new_group``, with only its
    members taking part, as a split has it, and its communicators its own (a split's would
    belong to the parent's generation).  Nothing is shared with the parent, so unlike torch's
    it needs no device bound to the default group.  Any other group torch splits itself."""
    import inspect

    c = sys.modules["torch.distributed.distributed_c10d"]
    a = inspect.signature(original).bind(*args, **kwargs).arguments
    parent = a.get("parent_pg") or c._get_default_group()
    if not isinstance(parent, DelegatingGroup) or getattr(c, "_use_torchcomms_enabled", lambda: False)():
        return original(*args, **kwargs)  # (torchcomms: its new_group splits, through this very call)
    ranks = c.get_process_group_ranks(parent)  # (the parent's group ranks, as global ranks)
    splits = a.get("split_ranks")
    if not splits:
        raise ValueError("split_ranks cannot be None or empty")
    for split in splits:
        if not split or len(set(split)) != len(split) or not all(0 <= r < len(ranks) for r in split):
            raise ValueError(f"{split!r} is not a split of a group of {len(ranks)} ranks")
    if len({r for split in splits for r in split}) != sum(len(split) for split in splits):
        raise ValueError(f"the splits {splits!r} overlap")
    # Every rank of the world makes every split of the world (as a DeviceMesh does without
    # split_group): the groups' names, which torch numbers in the order they are made, agree.  A
    # subgroup's members make only their own, named by its ranks (torch's names of groups made
    # by their members alone: they agree while the members have made the same groups before).
    world = parent is c._get_default_group()
    made = None
    for split in splits:
        member = parent.rank() in split
        if world or member:
            group = c.new_group(
                [ranks[r] for r in sorted(split)],
                timeout=a.get("timeout"),
                backend=a.get("backend") or parent.user_backend(),
                pg_options=a.get("pg_options"),
                group_desc=a.get("group_desc"),
                use_local_synchronization=not world,
            )
            made = group if member else made
    return made
