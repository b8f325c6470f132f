"""The rank side of the torch backend's tests: ``python3 torch_ranks.py CASE``.

Ranks join through a FileStore named by the job (``conftest.start_job`` sets the FLAGCX_*
variables); each check raises on a wrong value.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import flagcx
import flagcx.torch  # noqa: F401

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def device():
    if os.environ.get("FLAGCX_VENDOR") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@case
def ops(r, n):
    """Every op torch maps to the backend, with values only the right result has."""
    dev = device()
    R = dist.ReduceOp
    for op, want in [(R.SUM, sum(range(1, n + 1))), (R.MAX, n), (R.MIN, 1),
                     (R.PRODUCT, torch.arange(1, n + 1).prod().item())]:
        t = torch.full((5,), float(r + 1), device=dev)
        dist.all_reduce(t, op=op)
        check((t == want).all(), f"all_reduce {op}: {t}")
    t = torch.full((3,), float(r + 1), device=dev)
    dist.all_reduce(t, op=R.AVG)
    check(torch.allclose(t, torch.full_like(t, (n + 1) / 2)), f"all_reduce AVG: {t}")
    for bad in (R.BAND, R.BOR, R.BXOR):
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.int32, device=dev), op=bad)
            raise AssertionError(f"{bad} should raise")
        except Exception as e:  # torch may wrap it
            check("not supported" in str(e), f"{bad}: {e}")
    try:
        # torch's own constructor of a pre-multiplied sum (ReduceOp.PREMUL_SUM is not
        # callable in every torch version).
        dist.all_reduce(torch.ones(2, device=dev), op=dist._make_nccl_premul_sum(2.0))
        raise AssertionError("PREMUL_SUM should raise")
    except Exception as e:
        check("not supported" in str(e), f"PREMUL_SUM: {e}")

    w = dist.all_reduce(torch.ones(4, device=dev), async_op=True)
    check(w.wait(), "async wait")
    fut = dist.all_reduce(t2 := torch.ones(4, device=dev), async_op=True).get_future()
    fut.wait()
    check((t2 == n).all() and (fut.value()[0] == n).all(), f"future value: {fut.value()}")

    red = torch.full((4,), float(r), device=dev)
    dist.reduce(red, dst=n - 1)
    if r == n - 1:
        check((red == sum(range(n))).all(), f"reduce: {red}")

    b = torch.full((6,), float(r), device=dev)
    dist.broadcast(b, src=n - 1)
    check((b == n - 1).all(), f"broadcast: {b}")

    out = torch.zeros(2 * n, device=dev)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r), device=dev))
    check(torch.equal(out.cpu(), torch.arange(n).repeat_interleave(2).float()),
          f"all_gather_into_tensor: {out}")
    lst = [torch.zeros(2, device=dev) for _ in range(n)]
    dist.all_gather(lst, torch.full((2,), float(r), device=dev))
    check(all((lst[q] == q).all() for q in range(n)), f"all_gather list: {lst}")

    inp = torch.arange(3 * n, dtype=torch.float32, device=dev) + r
    rs = torch.zeros(3, device=dev)
    dist.reduce_scatter_tensor(rs, inp)
    want = torch.arange(3 * n, dtype=torch.float32)[3 * r:3 * r + 3] * n + sum(range(n))
    check(torch.equal(rs.cpu(), want), f"reduce_scatter_tensor: {rs}")
    rs2 = torch.zeros(3, device=dev)
    dist.reduce_scatter(rs2, list(inp.chunk(n)))
    check(torch.equal(rs2.cpu(), want), f"reduce_scatter list: {rs2}")

    a_in = torch.tensor([100.0 * r + q for q in range(n)], device=dev)
    a_out = torch.zeros(n, device=dev)
    dist.all_to_all_single(a_out, a_in)
    check(torch.equal(a_out.cpu(), torch.tensor([100.0 * p + r for p in range(n)])),
          f"all_to_all_single: {a_out}")
    # Uneven: rank r sends q+1 rows to rank q.
    v_in = torch.cat([torch.full((q + 1, 2), 10.0 * r + q) for q in range(n)]).to(dev)
    v_out = torch.zeros((r + 1) * n, 2, device=dev)
    dist.all_to_all_single(v_out, v_in, [r + 1] * n, [q + 1 for q in range(n)])
    want = torch.cat([torch.full((r + 1, 2), 10.0 * p + r) for p in range(n)])
    check(torch.equal(v_out.cpu(), want), f"all_to_all_single uneven: {v_out}")
    outs = [torch.zeros(1, device=dev) for _ in range(n)]
    dist.all_to_all(outs, [torch.tensor([10.0 * r + q], device=dev) for q in range(n)])
    check(all(outs[p].item() == 10 * p + r for p in range(n)), f"all_to_all list: {outs}")

    g = [torch.zeros(2, device=dev) for _ in range(n)] if r == 0 else None
    dist.gather(torch.full((2,), float(r), device=dev), g, dst=0)
    if r == 0:
        check(all((g[q] == q).all() for q in range(n)), f"gather: {g}")
    s_out = torch.zeros(2, device=dev)
    s_in = [torch.full((2,), 3.0 * q, device=dev) for q in range(n)] if r == 0 else None
    dist.scatter(s_out, s_in, src=0)
    check((s_out == 3 * r).all(), f"scatter: {s_out}")

    right, left = (r + 1) % n, (r - 1) % n
    got = torch.zeros(4, device=dev)
    if r % 2 == 0:
        dist.send(torch.full((4,), float(r), device=dev), right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(torch.full((4,), float(r), device=dev), right)
    check((got == left).all(), f"send/recv: {got}")
    # A backend subclassing ProcessGroup (torch without a Python-constructible Backend, or
    # FLAGCX_TORCH_BASE=processgroup) has no per-device backend, which batch_isend_irecv needs.
    as_pg = isinstance(dist.group.WORLD, flagcx.torch.FlagcxBackend)
    if not as_pg:
        got2 = torch.zeros(4, device=dev)
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, torch.full((4,), 7.0 * r, device=dev), right),
            dist.P2POp(dist.irecv, got2, left)])
        for q in reqs:
            q.wait()
        check((got2 == 7 * left).all(), f"batch_isend_irecv: {got2}")
    else:
        print("skipped: batch_isend_irecv (the backend is a ProcessGroup subclass)")

    ts = [torch.full((k + 1,), float(r), device=dev) for k in range(3)]
    dist.all_reduce_coalesced(ts)
    check(all((t == sum(range(n))).all() for t in ts), f"all_reduce_coalesced: {ts}")
    with dist._coalescing_manager(device=dev):
        cs = [torch.full((2,), float(r + k), device=dev) for k in range(2)]
        for c in cs:
            dist.all_reduce(c)
    check(all((cs[k] == sum(range(n)) + n * k).all() for k in range(2)),
          f"coalescing manager: {cs}")

    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r})
    check([o["rank"] for o in objs] == list(range(n)), f"all_gather_object: {objs}")
    sub = dist.new_group(list(range(n)))
    t = torch.ones(2, device=dev)
    dist.all_reduce(t, group=sub)
    check((t == n).all(), "a second group")
    dist.barrier()


@case
def late_peer(r, n):
    """Every rank but the last reads its result at once with ``.item()`` (on a GPU rank a copy
    into pageable memory on torch's current stream: the legacy default stream, where the CUDA
    driver holds other threads' copies and launches until it ends), while the last rank posts
    each call 0.2 s late. The result must arrive: nothing the library needs to finish the call
    may wait behind that read (two CUDA ranks stopped so before GPU pairs copied late)."""
    dev = device()
    for size in (2, 1 << 16, 1 << 22):
        for i in range(2):
            t = torch.full((size,), float(r + 1), device=dev)
            if r == n - 1:
                time.sleep(0.2)
            dist.all_reduce(t)
            got = t[-1].item()
            check(got == n * (n + 1) / 2, f"all_reduce of {size} (round {i}): {got}")
            b = torch.full((size,), float(r), device=dev)
            if r == n - 1:
                time.sleep(0.2)
            dist.broadcast(b, n - 1)
            got = b[0].item()
            check(got == n - 1, f"broadcast of {size} (round {i}): {got}")


def _peer_dies(r, n, numel):
    dist.barrier()
    if r == n - 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        for _ in range(50):
            dist.all_reduce(torch.ones(numel))
        raise AssertionError("the all_reduce should fail")
    except Exception as e:  # noqa: BLE001 - torch wraps backend errors
        print(f"rank {r}: {type(e).__name__} after {time.monotonic() - t0:.2f} s: {e}")


@case
def peer_dies(r, n):
    """A rank exits; the others' next collective raises (the watchdog or the wait): 256 KiB
    all-reduces, which return a Work to wait for."""
    _peer_dies(r, n, 1 << 16)


@case
def peer_dies_small(r, n):
    """The same with 8-byte all-reduces, which finish inside the call: the call raises."""
    _peer_dies(r, n, 2)


def main():
    name = sys.argv[1]
    r, n = int(os.environ["FLAGCX_RANK"]), int(os.environ["FLAGCX_NRANKS"])
    job = os.environ["FLAGCX_UNIQUE_ID"].split("-")[1]
    store = dist.FileStore(f"/tmp/flagcx-test-{job}", n)
    dist.init_process_group("flagcx", store=store, rank=r, world_size=n)
    CASES[name](r, n)
    if not name.startswith("peer_dies"):
        dist.destroy_process_group()
    print(f"rank {r}: OK", flush=True)


if __name__ == "__main__":
    main()
