"""Starts the ranks of a one-host job without flagcx-run: ``python3 launch.py --vendors
cuda,host [--timeout S] -- SCRIPT ARGS...``.

Each rank gets FLAGCX_RANK, FLAGCX_NRANKS, FLAGCX_LOCAL_RANK, FLAGCX_UNIQUE_ID and its
FLAGCX_VENDOR; host-vendor ranks also get ``CUDA_VISIBLE_DEVICES=""`` (a CPU worker on a GPU
node: torch then puts nothing of theirs on a GPU). Output lines carry ``[rank]``; the exit code
is the worst rank's. Used by the GPU bundle, where pytest may be missing. A job still running at
``--timeout`` gets SIGABRT first (the ranks run with ``-X faulthandler``, so each prints every
thread's Python stack), then SIGKILL two seconds later.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import flagcx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vendors", required=True)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    vendors = args.vendors.split(",")
    uid, uid2 = flagcx.unique_id(), flagcx.unique_id()
    procs = []
    for rank, vendor in enumerate(vendors):
        env = dict(os.environ, FLAGCX_RANK=str(rank), FLAGCX_NRANKS=str(len(vendors)),
                   FLAGCX_LOCAL_RANK=str(rank), FLAGCX_UNIQUE_ID=uid, FLAGCX_VENDOR=vendor,
                   FLAGCX_UNIQUE_ID2=uid2,
                   PYTHONUNBUFFERED="1")
        if vendor == "host":
            env["CUDA_VISIBLE_DEVICES"] = ""
        procs.append(subprocess.Popen([sys.executable, "-X", "faulthandler", *cmd], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))

    def pump(rank, p):
        for line in p.stdout:
            print(f"[{rank}] {line}", end="", flush=True)

    threads = [threading.Thread(target=pump, args=(r, p)) for r, p in enumerate(procs)]
    for t in threads:
        t.start()
    worst = 0
    deadline = time.monotonic() + args.timeout
    for p in procs:
        try:
            rc = p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"launch: still running after {args.timeout} s: the ranks' stacks follow",
                  flush=True)
            for q in procs:
                if q.poll() is None:
                    q.send_signal(signal.SIGABRT)
            time.sleep(2)
            for q in procs:
                q.kill()
            rc = 124
        worst = max(worst, abs(rc))
    for t in threads:
        t.join()
    print(f"launch: {' '.join(cmd)} on {args.vendors}: exit {worst}", flush=True)
    return worst


if __name__ == "__main__":
    sys.exit(main())
