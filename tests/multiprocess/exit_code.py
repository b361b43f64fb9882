"""Run by tests/test_multiprocess.py: process 1 fails, the others would run
forever. The launcher must stop them and return process 1's status."""

import os
import sys
import time

import jax

print(f"PID {os.getpid()}", flush=True)
if jax.process_index() == 1:
    time.sleep(1.0)
    print("failing on purpose", flush=True)
    sys.exit(7)
while True:
    time.sleep(1.0)
