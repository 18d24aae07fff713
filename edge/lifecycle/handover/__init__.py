"""A handover to a new process on the same sockets: the old process's side (handover), the new
process's side (successor), and the CPU priority the new one starts at and takes back (priority)."""
