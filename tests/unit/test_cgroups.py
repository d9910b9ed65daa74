"""Which cgroup.procs files a process's control groups are (host.cgroups), from /proc texts."""

from __future__ import annotations

from host.cgroups import procs_files

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 /slurm /srv/devices rw,relatime - cgroup cgroup rw,devices
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_a_processs_groups_are_found_in_each_hierarchy_mounted_here() -> None:
    cgroup = """\
12:cpu,cpuacct:/slurm/uid_1000/job_7/step_0
11:memory:/slurm/uid_1000/job_7/step_0
10:devices:/slurm/uid_1000/job_7
9:name=systemd:/
8:pids:/slurm/uid_1000/job_7
0::/user.slice/user-1000.slice
"""
    assert procs_files(cgroup, MOUNTINFO) == (
        "/sys/fs/cgroup/cpu,cpuacct/slurm/uid_1000/job_7/step_0/cgroup.procs",
        "/sys/fs/cgroup/memory/slurm/uid_1000/job_7/step_0/cgroup.procs",
        "/srv/devices/uid_1000/job_7/cgroup.procs",  # (a hierarchy mounted from its /slurm)
        "/sys/fs/cgroup/unified/user.slice/user-1000.slice/cgroup.procs",
    )  # (the root groups, and pids, not mounted here, are left out)


def test_nothing_leads_out_of_a_hierarchy() -> None:
    assert procs_files("11:memory:/a/../../etc\n10:devices:/elsewhere\n", MOUNTINFO) == ()
