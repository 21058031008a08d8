"""One rank of the launcher's probe job (tests/training/test_slurm.py): what torchrun_job.sh
hands every rank of a multi-node job, without training.

Run by ``torchrun`` on each node. Prints one line with the rank, its host and the fabric
variables it was given, then waits for the warning signal the launcher passes on (SIGUSR1)
and prints a second line when it arrives; exits 1 with a line saying so if none comes within
PROBE_WAIT_S seconds.
"""

import os
import signal
import socket
import sys
import time

PROBE_WAIT_S = 300.0
FABRIC = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")

received = []
signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
rank, host = os.environ["RANK"], socket.gethostname()
fabric = " ".join(f"{name}={os.environ.get(name, '<unset>')}" for name in FABRIC)
print(f"probe: rank {rank} of {os.environ['WORLD_SIZE']} on {host}: {fabric}", flush=True)
deadline = time.monotonic() + PROBE_WAIT_S
while not received and time.monotonic() < deadline:
    time.sleep(0.1)
if not received:
    print(f"probe: rank {rank} on {host}: no SIGUSR1 within {PROBE_WAIT_S:g} s", flush=True)
    sys.exit(1)
print(f"probe: rank {rank} on {host}: received SIGUSR1", flush=True)
