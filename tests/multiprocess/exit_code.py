"""Run by tests/test_multiprocess.py: process 1 fails, the others would run
forever. The launcher must stop them and return process 1's status."""

import os
import sys
import time

import jax
from report import report

report("pid", pid=os.getpid())
if jax.process_index() == 1:
    time.sleep(1.0)
    report("failing", status=7)
    sys.exit(7)
while True:
    time.sleep(1.0)
