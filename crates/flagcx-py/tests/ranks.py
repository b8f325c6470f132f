"""The rank side of the package's multi-process tests: ``python3 ranks.py CASE``.

Every rank of a job runs one case (``conftest.run_job`` starts them with ``FLAGCX_RANK``,
``FLAGCX_NRANKS``, ``FLAGCX_UNIQUE_ID`` and ``FLAGCX_VENDOR`` set) and exits 0 only if each of
its checks held; a failed check raises, naming what differed.
"""

import os
import signal
import sys
import time

import numpy as np

import flagcx

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def buffers(comm, n, dtype):
    """Two kinds of buffer every case runs on: a plain numpy array (registered for the call
    and used in place on host ranks, staged through device memory elsewhere) and one in the
    communicator's own memory (used in place where the vendor allows)."""
    yield "numpy", np.zeros(n, dtype=dtype)
    # Every rank runs as many calls: where the device's memory has no host address (OpenCL),
    # the second is a numpy array again.
    if comm.vendor == "host":
        yield "flagcx.empty", flagcx.empty(comm, n, dtype)
    else:
        yield "numpy again", np.zeros(n, dtype=dtype)


@case
def collectives(comm):
    """Every collective, with values only the right data movement gives."""
    r, n = comm.rank, comm.nranks
    for kind, x in buffers(comm, 1000, np.float32):
        x[:] = np.arange(1000, dtype=np.float32) * (r + 1)
        comm.all_reduce(x)
        want = np.arange(1000, dtype=np.float32) * sum(range(1, n + 1))
        check(np.array_equal(x, want), f"{kind} all_reduce sum in place: {x[:4]} != {want[:4]}")

    src = np.full(7, r + 1, dtype=np.int32)
    out = np.zeros(7, dtype=np.int32)
    comm.all_reduce(src, "max", out)
    check((out == n).all() and (src == r + 1).all(), f"all_reduce max out of place: {out}")
    comm.all_reduce(src, "min", out)
    check((out == 1).all(), f"all_reduce min: {out}")
    f = np.full(5, float(r + 1), dtype=np.float32)
    comm.all_reduce(f, "avg")
    check(np.allclose(f, (n + 1) / 2), f"all_reduce avg: {f}")
    p = np.full(3, 2, dtype=np.int64)
    comm.all_reduce(p, "prod")
    check((p == 2 ** n).all(), f"all_reduce prod: {p}")

    for root in range(n):
        red = np.full(4, r, dtype=np.int64)
        comm.reduce(red, root)
        if r == root:
            check((red == sum(range(n))).all(), f"reduce to {root}: {red}")

    inp = np.arange(3 * n, dtype=np.float32) + r
    rs = np.zeros(3, dtype=np.float32)
    comm.reduce_scatter(inp, rs)
    want = (np.arange(3 * n, dtype=np.float32)[3 * r: 3 * r + 3]) * n + sum(range(n))
    check(np.array_equal(rs, want), f"reduce_scatter: {rs} != {want}")

    b = np.full(6, r, dtype=np.uint8)
    comm.broadcast(b, n - 1)
    check((b == n - 1).all(), f"broadcast in place: {b}")

    g = np.zeros(2 * n, dtype=np.int32)
    comm.all_gather(np.full(2, r, dtype=np.int32), g)
    check(np.array_equal(g, np.repeat(np.arange(n, dtype=np.int32), 2)), f"all_gather: {g}")

    ga = np.zeros(n, dtype=np.int64) if r == 0 else None
    comm.gather(np.array([10 * r], dtype=np.int64), ga, 0)
    if r == 0:
        check(np.array_equal(ga, 10 * np.arange(n)), f"gather: {ga}")

    sc = np.arange(n, dtype=np.float64) * 3 if r == 0 else None
    mine = np.zeros(1, dtype=np.float64)
    comm.scatter(sc, mine, 0)
    check(mine[0] == 3 * r, f"scatter: {mine}")

    a2a_in = np.array([100 * r + q for q in range(n)], dtype=np.int32)
    a2a_out = np.zeros(n, dtype=np.int32)
    comm.all_to_all(a2a_in, a2a_out)
    check(np.array_equal(a2a_out, np.array([100 * p + r for p in range(n)])),
          f"all_to_all: {a2a_out}")

    # Uneven: rank r sends q+1 elements to rank q.
    sends = [q + 1 for q in range(n)]
    recvs = [r + 1] * n
    vin = np.concatenate([np.full(q + 1, 10 * r + q, dtype=np.int32) for q in range(n)])
    vout = np.full(sum(recvs), -1, dtype=np.int32)
    comm.all_to_all(vin, vout, sends, recvs)
    want = np.concatenate([np.full(r + 1, 10 * p + r, dtype=np.int32) for p in range(n)])
    check(np.array_equal(vout, want), f"all_to_allv: {vout} != {want}")

    comm.barrier()


@case
def point_to_point(comm):
    """send/recv around a ring, a short receive, groups, async Works and a dropped Work."""
    r, n = comm.rank, comm.nranks
    right, left = (r + 1) % n, (r - 1) % n
    for kind, buf in buffers(comm, 4096, np.float32):
        out = np.arange(4096, dtype=np.float32) + r
        with comm.group():
            ws = comm.send(out, right)
            wr = comm.recv(buf, left)
        check(isinstance(ws, flagcx.Work) and isinstance(wr, flagcx.Work),
              "calls in a group return Works")
        check(wr.wait() == 4096 * 4, "recv reports the bytes received")
        ws.wait()
        check(np.array_equal(buf, np.arange(4096, dtype=np.float32) + left), f"{kind} ring")

    # A receive longer than the message: the bytes past it keep their contents.
    if n >= 2 and r < 2:
        if r == 0:
            comm.send(np.arange(3, dtype=np.int64), 1)
        else:
            got = np.full(8, -7, dtype=np.int64)
            check(comm.recv(got, 0) == 24, "short receive's size")
            check(np.array_equal(got, [0, 1, 2, -7, -7, -7, -7, -7]), f"short receive: {got}")

    # async_op: wait later; is_completed; a Work dropped unfinished keeps its buffer alive.
    x = np.ones(1 << 16, dtype=np.float32)
    w = comm.all_reduce(x, async_op=True)
    check(w.wait() is None and w.is_completed(), "async all_reduce")
    check(w.wait() is None, "waiting again returns the same result")
    check((x == n).all(), "async all_reduce values")
    comm.all_reduce(np.ones(1 << 16, dtype=np.float32), async_op=True)  # dropped at once
    comm.barrier()


@case
def host_memory_in_place(comm):
    """Numpy arrays used in place on host ranks (registered per call, reached by the peer
    through the kernel): large ones through the ring, and overlapping views in flight at
    once (the second's registration is refused, so it is staged)."""
    r, n = comm.rank, comm.nranks
    right, left = (r + 1) % n, (r - 1) % n
    x = (np.arange((1 << 20) + 3) % 251).astype(np.float32) * (r + 1)
    comm.all_reduce(x)
    want = (np.arange((1 << 20) + 3) % 251).astype(np.float32) * (n * (n + 1) // 2)
    check(np.array_equal(x, want), "a 4 MiB all_reduce of numpy arrays")
    a = np.arange(3000, dtype=np.float64) + 1000 * r
    b1, b2 = np.zeros(1000), np.zeros(1000)
    with comm.group():
        w = [comm.send(a[0:1000], right), comm.send(a[500:1500], right),
             comm.recv(b1, left), comm.recv(b2, left)]
    for x in w:
        x.wait()
    theirs = np.arange(3000, dtype=np.float64) + 1000 * left
    check(np.array_equal(b1, theirs[0:1000]), "the first of two overlapping views")
    check(np.array_equal(b2, theirs[500:1500]), "the second of two overlapping views")
    big = np.full(1 << 21, float(r), dtype=np.float32)
    got = np.zeros(1 << 21, dtype=np.float32)
    with comm.group():
        ws = comm.send(big, right)
        wr = comm.recv(got, left)
    ws.wait()
    check(wr.wait() == big.nbytes and (got == left).all(), "an 8 MiB message in place")
    # Reductions in a group run at its end: each Work is done only once its reduction ran
    # (a grouped ring all-reduce's Work used to finish at once, with the arrays untouched).
    tri = n * (n + 1) // 2
    for k in (3, 1000, 100003):
        ts = [np.full(k, float(r + 1) * (j + 1), dtype=np.float32) for j in range(3)]
        with comm.group():
            ws = [comm.all_reduce(t, "sum", async_op=True) for t in ts]
        for w in ws:
            w.wait()
        for j, t in enumerate(ts):
            check((t == tri * (j + 1)).all(), f"all_reduce {j} of a group of 3 x {k}: {t[:3]}")
    comm.barrier()


@case
def dtypes(comm):
    """Each element type through a reduction, beside a bool (moves, does not reduce)."""
    n = comm.nranks
    no_f64 = os.environ.get("FLAGCX_TEST_NO_F64") == "1"
    for dt in [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16,
               np.float32, np.float64]:
        x = np.full(33, 1 + comm.rank, dtype=dt)
        if dt == np.float64 and no_f64:
            # A rank's device cannot reduce float64 exactly (PoCL): a typed error everywhere.
            try:
                comm.all_reduce(x)
                raise AssertionError("a float64 all_reduce should raise here")
            except flagcx.Unsupported:
                continue
        comm.all_reduce(x)
        check((x == dt(n * (n + 1) // 2)).all(), f"{np.dtype(dt).name}: {x[:3]}")
    try:
        comm.all_reduce(np.zeros(4, dtype=np.bool_))
        raise AssertionError("a bool all_reduce should raise")
    except flagcx.Unsupported as e:
        check("bool" in str(e), f"the message names the type: {e}")
    b = np.array([comm.rank == 0] * 4, dtype=np.bool_)
    comm.broadcast(b, 0)
    check(b.all(), "bool broadcast")


@case
def bad_arguments(comm):
    """Errors a user makes get exceptions naming the problem; the communicator stays usable."""
    def raises(exc, fn, words):
        try:
            fn()
        except exc as e:
            check(words in str(e), f"{exc.__name__} message {str(e)!r} lacks {words!r}")
            return
        raise AssertionError(f"expected {exc.__name__}")

    a = np.zeros((4, 4), dtype=np.float32)
    raises(ValueError, lambda: comm.all_reduce(a[:, 1]), "not contiguous")
    ro = np.zeros(4, dtype=np.float32)
    ro.setflags(write=False)
    raises(ValueError, lambda: comm.all_reduce(ro), "cannot use this buffer")
    raises(TypeError, lambda: comm.all_reduce([1.0, 2.0]), "numpy")
    raises(flagcx.Unsupported, lambda: comm.all_reduce(np.zeros(2, np.float32), "band"),
           "sum, prod, max, min and avg")
    raises(flagcx.InvalidArgument,
           lambda: comm.all_gather(np.zeros(2, np.float32), np.zeros(3, np.float32)),
           "needs")
    raises(flagcx.InvalidArgument, lambda: comm.send(np.zeros(1), comm.nranks + 3),
           "out of range")
    x = np.ones(2, np.float32)
    comm.all_reduce(x)
    check((x == comm.nranks).all(), "usable after bad calls")


@case
def logs(comm):
    """Library logs reach Python's logging."""
    import logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    logging.getLogger().addHandler(Keep())
    logging.getLogger().setLevel(logging.INFO)
    flagcx.reset_logging()
    with flagcx.Comm(comm.rank, comm.nranks, os.environ["FLAGCX_UNIQUE_ID2"]) as c2:
        c2.barrier()
    check(any(r.name.startswith("flagcx") for r in seen),
          f"no flagcx record among {[r.name for r in seen][:5]}")


@case
def peer_dies(comm):
    """The last rank exits mid-job; every other rank's call raises instead of hanging."""
    r, n = comm.rank, comm.nranks
    comm.barrier()
    if r == n - 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(1 << 20, dtype=np.float32))
        raise AssertionError("the all_reduce should fail")
    except (flagcx.PeerLost, flagcx.RemoteFailure, flagcx.Timeout, flagcx.Aborted) as e:
        print(f"rank {r}: {type(e).__name__} after {time.monotonic() - t0:.2f} s: {e}")


@case
def interrupt(comm):
    """^C in a blocked receive raises KeyboardInterrupt (the parent sends SIGINT to rank 0)."""
    if comm.rank == 0:
        print("READY", flush=True)
        try:
            comm.recv(np.zeros(4, np.float32), 1)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            return
        raise AssertionError("the receive returned")
    else:
        time.sleep(30)


def main():
    name = sys.argv[1]
    if name == "interrupt":
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with flagcx.Comm.from_env() as comm:
        CASES[name](comm)
    print(f"rank {os.environ['FLAGCX_RANK']}: OK", flush=True)


if __name__ == "__main__":
    main()
