"""Data-parallel training over the flagcx torch backend: CPU ranks, CUDA ranks, or both.

    flagcx-run -n 2 -- python3 examples/ddp.py                 # two CPU ranks
    flagcx-run -n 2 --vendors cuda,host -- python3 examples/ddp.py   # a CUDA rank and a CPU rank
    torchrun --nproc-per-node 2 examples/ddp.py

Each rank trains a small MLP (fixed seeds, SGD, no dropout or batch norm) on its own slice of
a synthetic regression set with ``DistributedDataParallel``. After every step it checks what
data parallelism promises, and says so:

* the gradients after the all-reduce are bit-identical on every rank;
* on ranks of one device type, the parameters are bit-identical too;
* with ``--check``, rank 0 also trains the same model in one process on the concatenated
  batches and the losses agree within ``rtol=1e-5, atol=1e-6`` (float32 summation order
  differs between the two; across device types, CPU and CUDA kernels round differently, so
  the tolerance is ``1e-4``).

Exits non-zero on any mismatch.
"""

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import flagcx.torch  # noqa: F401  (registers the "flagcx" backend)


def init():
    """Joins the job: torchrun's environment (MASTER_ADDR, RANK, WORLD_SIZE), else
    flagcx-run's (FLAGCX_RANK, FLAGCX_NRANKS, FLAGCX_UNIQUE_ID) through a file store."""
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("flagcx")
    else:
        rank, n = int(os.environ["FLAGCX_RANK"]), int(os.environ["FLAGCX_NRANKS"])
        job = os.environ["FLAGCX_UNIQUE_ID"].split("-")[1]
        store = dist.FileStore(f"/tmp/flagcx-ddp-{job}", n)
        dist.init_process_group("flagcx", store=store, rank=rank, world_size=n)
    return dist.get_rank(), dist.get_world_size()


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


def data(n, batch, steps):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, n * batch, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(steps, n * batch, 1, generator=g)
    return x, y


def same_everywhere(t, what, device):
    """Whether `t` holds the same bits on every rank (its bytes all-gathered and compared)."""
    flat = t.detach().reshape(-1).contiguous()
    bits = flat.view(torch.int32) if flat.dtype == torch.float32 else flat
    rows = torch.empty(dist.get_world_size(), bits.numel(), dtype=bits.dtype, device=device)
    dist.all_gather_into_tensor(rows, bits.to(device))
    ok = bool((rows == rows[0]).all())
    if not ok:
        print(f"rank {dist.get_rank()}: {what} differs between ranks", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--check", action="store_true",
                    help="rank 0 also trains in one process and compares the losses")
    ap.add_argument("--side-stream", action="store_true",
                    help="CUDA ranks run on a stream of their own instead of the legacy "
                         "default stream (torch's current stream unless a program sets one)")
    args = ap.parse_args()

    rank, n = init()
    cuda = os.environ.get("FLAGCX_VENDOR", "cuda" if torch.cuda.is_available() else "host")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda == "cuda" else \
        torch.device("cpu")
    if args.side_stream and device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream(device))
    kinds = [None] * n
    dist.all_gather_object(kinds, device.type)
    one_kind = len(set(kinds)) == 1

    net = model().to(device)
    reference = copy.deepcopy(net).cpu() if (args.check and rank == 0) else None
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    # A few batches seen again and again: the loss falls visibly within the run.
    x, y = data(n, args.batch, 4)
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    ok = True
    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        b = step % len(x)
        loss = nn.functional.mse_loss(ddp(x[b, mine].to(device)), y[b, mine].to(device))
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        ok &= same_everywhere(grads, f"step {step}: gradients", device)
        opt.step()
        if one_kind:
            params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
            ok &= same_everywhere(params, f"step {step}: parameters", device)
        # The global loss: the mean of the ranks' means (equal batches).
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(float(total))
    if rank == 0:
        print(f"losses: {losses[0]:.6f} -> {losses[-1]:.6f} over {args.steps} steps on "
              f"{n} ranks ({', '.join(kinds)})", flush=True)
    if reference is not None:
        ropt = torch.optim.SGD(reference.parameters(), lr=args.lr)
        tol = 1e-5 if one_kind else 1e-4
        for step in range(args.steps):
            ropt.zero_grad()
            rl = nn.functional.mse_loss(reference(x[step % len(x)]), y[step % len(x)])
            rl.backward()
            ropt.step()
            one = rl.item()
            if abs(one - losses[step]) > tol * abs(one) + 1e-6:
                print(f"step {step}: loss {losses[step]:.8f}, one process {one:.8f}",
                      flush=True)
                ok = False
        if ok:
            print(f"one-process losses agree within rtol {tol}", flush=True)
    print(f"rank {rank}: {'OK' if ok else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
