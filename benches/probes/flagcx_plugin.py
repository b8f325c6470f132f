"""FlagCX's own torch plugin over our libflagcx (run by flagcx_plugin.sh), two CUDA ranks on one
GPU: every op the issue found wrong, and the reductions, tensors from torch's caching
allocator, segments freed (empty_cache) and allocated again between rounds, results read on
torch's current stream. One line per op and round; exit status 1 on any wrong element."""
import os, sys, torch
import flagcx  # noqa: F401  (the plugin: registers the backend)
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:flagcx", rank=rank, world_size=world)
dev = torch.device("cuda", 0)
bad = 0
N = 1 << 18  # 1 MiB of float32


def full(v, n=N):
    """A tensor of n elements equal to v, on the rank's GPU."""
    return torch.full((n,), float(v), device=dev)


def check(name, got, want):
    """Whether got equals want element for element; counts and prints a mismatch."""
    global bad
    ok = torch.equal(got.cpu(), want.cpu())
    if not ok:
        bad += 1
        diff = (got.cpu() != want.cpu()).sum().item()
        print(f"rank {rank}: {name}: WRONG ({diff} elements)", flush=True)
    return ok


def run(name, fn):
    """Runs one op check, printing ok, WRONG or the error it raised."""
    global bad
    try:
        ok = fn()
        print(f"rank {rank}: {name}: {'ok' if ok else 'WRONG'}", flush=True)
    except Exception as e:  # an op the plugin or library refuses
        bad += 1
        print(f"rank {rank}: {name}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)


for it in range(4):
    peer = 1 - rank

    def sendrecv():
        """dist.send from rank 0, dist.recv on rank 1."""
        if rank == 0:
            dist.send(full(1 + it), 1)
            return True
        t = full(-1)
        dist.recv(t, 0)
        return check("recv", t, full(1 + it))

    def broadcast():
        """dist.broadcast from rank 0."""
        b = torch.arange(N, dtype=torch.float32, device=dev) * (it + 1) if rank == 0 else full(-1)
        dist.broadcast(b, 0)
        return check("broadcast", b, torch.arange(N, dtype=torch.float32, device=dev) * (it + 1))

    def all_gather():
        """dist.all_gather_into_tensor."""
        out = full(-1, world * N)
        dist.all_gather_into_tensor(out, full(rank * 10 + it))
        return check("all_gather", out, torch.cat([full(r * 10 + it) for r in range(world)]))

    def all_to_all():
        """dist.all_to_all_single with even splits."""
        inp = torch.cat([full(rank * 100 + r + it) for r in range(world)])
        o = full(-1, world * N)
        dist.all_to_all_single(o, inp)
        return check("all_to_all", o, torch.cat([full(r * 100 + rank + it) for r in range(world)]))

    def all_to_all_uneven():
        """dist.all_to_all_single with uneven splits."""
        # rank r sends (q + 1) * 1000 elements to rank q
        send_splits = [(q + 1) * 1000 for q in range(world)]
        recv_splits = [(rank + 1) * 1000 for _ in range(world)]
        inp = torch.cat([full(rank * 7 + q + it, s) for q, s in enumerate(send_splits)])
        o = full(-1, sum(recv_splits))
        dist.all_to_all_single(o, inp, recv_splits, send_splits)
        want = torch.cat([full(q * 7 + rank + it, s) for q, s in enumerate(recv_splits)])
        return check("all_to_all_uneven", o, want)

    def scatter():
        """dist.scatter from rank 0."""
        o = full(-1)
        chunks = [full(r + 50 + it) for r in range(world)] if rank == 0 else None
        dist.scatter(o, chunks, src=0)
        return check("scatter", o, full(rank + 50 + it))

    def gather():
        """dist.gather to rank 0."""
        gl = [full(-1) for _ in range(world)] if rank == 0 else None
        dist.gather(full(rank + 70 + it), gl, dst=0)
        if rank != 0:
            return True
        return check("gather", torch.cat(gl), torch.cat([full(r + 70 + it) for r in range(world)]))

    def batch():
        """dist.batch_isend_irecv, both ways at once."""
        s, r = full(rank + 90 + it), full(-1)
        ops = [dist.P2POp(dist.isend, s, peer), dist.P2POp(dist.irecv, r, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return check("batch_isend_irecv", r, full(peer + 90 + it))

    def all_reduce():
        """dist.all_reduce (sum)."""
        t = torch.arange(N, dtype=torch.float32, device=dev) + rank + it
        dist.all_reduce(t)
        want = sum(torch.arange(N, dtype=torch.float32, device=dev) + r + it for r in range(world))
        return check("all_reduce", t, want)

    def reduce_scatter():
        """dist.reduce_scatter_tensor (sum)."""
        inp = torch.cat([full(rank + q + it) for q in range(world)])
        o = full(-1)
        dist.reduce_scatter_tensor(o, inp)
        return check("reduce_scatter", o, full(sum(r + rank + it for r in range(world))))

    def reduce():
        """dist.reduce (sum) to rank 0."""
        t = full(rank + 3 + it)
        dist.reduce(t, dst=0)
        return check("reduce", t, full(sum(r + 3 + it for r in range(world)))) if rank == 0 else True

    def barrier():
        """dist.barrier."""
        dist.barrier()
        return True

    for name, fn in [("send/recv", sendrecv), ("broadcast", broadcast), ("all_gather", all_gather),
                     ("all_to_all", all_to_all), ("all_to_all uneven", all_to_all_uneven),
                     ("scatter", scatter), ("gather", gather), ("batch_isend_irecv", batch),
                     ("all_reduce", all_reduce), ("reduce_scatter", reduce_scatter),
                     ("reduce", reduce), ("barrier", barrier)]:
        run(f"round {it} {name}", fn)
    # Segments freed and allocated again (the caching allocator's empty_cache).
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

print(f"rank {rank}: {'every byte right' if bad == 0 else f'{bad} failures'}", flush=True)
dist.destroy_process_group()
sys.exit(1 if bad else 0)
