"""A handover to a new process on the same sockets: the old process's side (handover), the new
process's side (successor), the queued requests the old one passes on with their connections
(pass_on), and the CPU priority the new one starts at and takes back (priority)."""
