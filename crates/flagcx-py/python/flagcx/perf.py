"""Latency and bandwidth of the Python package, its torch backend and gloo, per call.

    python3 -m flagcx.perf -n 2 -t allreduce -b 8 -e 64K          # the package's calls
    python3 -m flagcx.perf -n 2 -t allreduce --torch                 # + torch.distributed over
                                                                     #   flagcx and over gloo
    flagcx-py-perf ...                                               # the same, installed

Run without a launcher, it starts ``-n`` ranks of itself on this host (host-vendor ranks by
default; ``--vendor``). Every call is waited for before the next, as a Python caller does
(``flagcx-perf --blocking`` times the Rust API the same way). Each size runs ``-r`` rounds of
``-i`` calls after ``-w`` warm-up calls; a row gives the median round's time per call and its
bandwidth (bytes ÷ time). ``--json`` prints one JSON object per row instead.

Columns: ``flagcx`` the package's call on buffers of the communicator's memory (used in
place); ``numpy`` the same call on numpy arrays (registered and used in place on host ranks,
staged through device memory on others);
``torch`` ``torch.distributed`` over the ``flagcx`` backend; ``gloo`` over gloo; ``torch+``
what the torch backend adds to the package's call (µs).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import flagcx

TESTS = ("allreduce", "sendrecv", "allgather", "broadcast")


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def sizes(begin, end, factor):
    s = begin
    while s <= end:
        yield s
        s *= factor


def timed(fn, iters, warmup, rounds):
    """The median round's seconds per call of `fn`."""
    for _ in range(warmup):
        fn()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per.append((time.perf_counter() - t0) / iters)
    return statistics.median(per)


def package_call(comm, test, buf, out):
    n, r = comm.nranks, comm.rank
    if test == "allreduce":
        return lambda: comm.all_reduce(buf)
    if test == "broadcast":
        return lambda: comm.broadcast(buf, 0)
    if test == "allgather":
        return lambda: comm.all_gather(buf, out)

    def sendrecv():
        with comm.group():
            s = comm.send(buf, (r + 1) % n)
            v = comm.recv(out[: len(buf)], (r - 1) % n)
        s.wait()
        v.wait()

    return sendrecv


def torch_call(dist, test, t, out, group):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if test == "allreduce":
        return lambda: dist.all_reduce(t, group=group)
    if test == "broadcast":
        return lambda: dist.broadcast(t, 0, group=group)
    if test == "allgather":
        return lambda: dist.all_gather_into_tensor(out, t, group=group)

    def sendrecv():
        ops = [dist.P2POp(dist.isend, t, (r + 1) % n, group),
               dist.P2POp(dist.irecv, out[: t.numel()], (r - 1) % n, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    return sendrecv


def rank_main(args):
    import numpy as np

    comm = flagcx.Comm.from_env()
    r, n = comm.rank, comm.nranks
    dist = None
    if args.torch:
        import torch
        import torch.distributed as dist

        import flagcx.torch as _registers  # noqa: F401  (the "flagcx" backend)

        job = os.environ["FLAGCX_UNIQUE_ID"].split("-")[1]
        store = dist.FileStore(f"/tmp/flagcx-perf-{job}", n)
        dist.init_process_group("flagcx", store=store, rank=r, world_size=n)
        gloo = dist.new_group(backend="gloo")
    rows = []
    for size in sizes(args.begin, args.end, args.factor):
        count = max(size // 4, 1)
        row = {"test": args.test, "ranks": n, "bytes": count * 4}
        cols = {}
        if comm.vendor == "host":
            buf = flagcx.empty(comm, count, "float32")
            out = flagcx.empty(comm, count * n, "float32")
            cols["flagcx"] = package_call(comm, args.test, buf, out)
        a, b = np.zeros(count, np.float32), np.zeros(count * n, np.float32)
        cols["numpy"] = package_call(comm, args.test, a, b)
        if dist is not None:
            t, o = torch.zeros(count), torch.zeros(count * n)
            cols["torch"] = torch_call(dist, args.test, t, o, None)
            cols["gloo"] = torch_call(dist, args.test, t, o, gloo)
        for name, fn in cols.items():
            comm.barrier()
            iters = args.iters if size <= (1 << 20) else max(args.iters // 10, 3)
            row[name + "_us"] = timed(fn, iters, args.warmup, args.rounds) * 1e6
        if "torch_us" in row:
            base = row.get("flagcx_us", row["numpy_us"])
            row["torch_added_us"] = row["torch_us"] - base
            row["torch_over_gloo"] = row["gloo_us"] / row["torch_us"]
        rows.append(row)
    if r == 0:
        report(rows, args)
    comm.barrier()
    if dist is not None:
        dist.destroy_process_group()
    comm.close()


def report(rows, args):
    if args.json:
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    cols = [c for c in ("flagcx_us", "numpy_us", "torch_us", "gloo_us", "torch_added_us",
                        "torch_over_gloo") if c in rows[0]]
    head = {"flagcx_us": "flagcx µs", "numpy_us": "numpy µs", "torch_us": "torch µs",
            "gloo_us": "gloo µs", "torch_added_us": "torch+ µs", "torch_over_gloo": "gloo÷torch"}
    print(f"# {args.test}, {rows[0]['ranks']} ranks, median of {args.rounds} rounds "
          f"({flagcx.version()})")
    print(f"{'bytes':>10} " + " ".join(f"{head[c]:>11}" for c in cols))
    for row in rows:
        print(f"{row['bytes']:>10} " + " ".join(f"{row[c]:>11.2f}" for c in cols), flush=True)


def floor(args):
    """torch's own cost of reaching a Python backend, next to ours, in one process: a
    one-rank group whose backend returns a finished ``Work`` at once, then a one-rank group of
    the ``flagcx`` backend (whose collectives have nothing to move there)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend

    import flagcx.torch as _registers  # noqa: F401  (the "flagcx" backend)

    class Done(dist.Work):
        def __init__(self):
            super().__init__()

        def wait(self, timeout=None):
            return True

    class Noop(Backend):
        def __init__(self, store, rank, size, timeout):
            super().__init__(rank, size)

        def getBackendName(self):
            return "flagcx-noop"

        def allreduce(self, tensors, opts):
            return Done()

    if not hasattr(dist.Backend, "FLAGCX_NOOP"):
        dist.Backend.register_backend("flagcx-noop", Noop, devices=["cpu"])
    t = torch.zeros(2)
    rows = {}
    for name in ("flagcx-noop", "flagcx"):
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1)
        rows[name] = timed(lambda: dist.all_reduce(t), args.iters * 10, args.warmup,
                           args.rounds) * 1e6
        dist.destroy_process_group()
    if args.json:
        print(json.dumps({"test": "floor", "noop_us": rows["flagcx-noop"],
                          "flagcx_us": rows["flagcx"]}))
    else:
        print(f"one-rank dist.all_reduce of 8 bytes, median of {args.rounds} rounds: "
              f"a no-op Python backend {rows['flagcx-noop']:.2f} µs (torch's floor), "
              f"flagcx {rows['flagcx']:.2f} µs")


def launch(args, argv):
    uid = flagcx.unique_id()
    vendors = (args.vendor or "host").split(",")
    procs = []
    for rank in range(args.nranks):
        env = dict(os.environ, FLAGCX_RANK=str(rank), FLAGCX_NRANKS=str(args.nranks),
                   FLAGCX_LOCAL_RANK=str(rank), FLAGCX_UNIQUE_ID=uid,
                   FLAGCX_VENDOR=vendors[rank % len(vendors)])
        procs.append(subprocess.Popen([sys.executable, "-m", "flagcx.perf", *argv], env=env))
    return max(p.wait() for p in procs)


def main(argv=None):
    """The ``flagcx-py-perf`` command."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="flagcx-py-perf", description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nranks", type=int, default=2)
    ap.add_argument("-t", "--test", choices=TESTS, default="allreduce")
    ap.add_argument("-b", "--begin", type=parse_size, default=8)
    ap.add_argument("-e", "--end", type=parse_size, default=64 << 10)
    ap.add_argument("-f", "--factor", type=int, default=8)
    ap.add_argument("-i", "--iters", type=int, default=200)
    ap.add_argument("-w", "--warmup", type=int, default=20)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--vendor", help="vendor per rank, comma-separated (default host)")
    ap.add_argument("--torch", action="store_true",
                    help="also torch.distributed over flagcx and over gloo")
    ap.add_argument("--floor", action="store_true",
                    help="instead: torch's cost of reaching any Python backend, in one process")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.floor:
        floor(args)
        return 0
    if "FLAGCX_RANK" not in os.environ:
        return launch(args, argv)
    rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
