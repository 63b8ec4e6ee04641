"""Every byte a process tree sends and receives over TCP, from the kernel's own counters:
``sock_diag`` reads each socket's counters over NETLINK_SOCK_DIAG, ``ledger`` (pure) says which
sockets are the tree's and sums them across polls, ``meter`` polls in a thread and reports.
"""
