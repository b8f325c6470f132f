"""The verdict table of targets.sh: reads the JSON rows flagcx-perf wrote (--json-file) and
port_pingpong's log in the directory given, and prints one line per target of the open issues
(#17, #19, #23): the worst value over the target's range, the target, and met / MISSED.
Standard library only (the GPU hosts have no Rust)."""
import json
import os
import re
import sys

MIB = 1 << 20


def rows(d, name):
    path = os.path.join(d, name + ".json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(d):
    out = []
    wrong = 0

    def verdict(issue, what, value, target, higher_better=True, fmt="{:.2f}"):
        goal = (">= " if higher_better else "<= ") + fmt.format(target)
        if value is None:
            out.append((issue, what, "-", goal, "NO DATA"))
            return
        ok = value >= target if higher_better else value <= target
        out.append((issue, what, fmt.format(value), goal, "met" if ok else "MISSED"))

    def worst(name, key, low=0, high=None, pick=min):
        vals = [r[key] for r in rows(d, name) if r["bytes"] >= low and (high is None or r["bytes"] <= high) and r.get(key) is not None]
        return pick(vals) if vals else None

    names = [f[:-5] for f in os.listdir(d) if f.endswith(".json")]
    for n in names:
        wrong += sum(r["wrong"] for r in rows(d, n))
    for t in ["allgather", "alltoall", "broadcast"]:
        verdict("#19", f"{t} busbw / NCCL's, 8 B-1 GiB", worst("nccl-" + t, "vs_nccl"), 1.0)
    verdict("#16", "sendrecv busbw / NCCL's, 8 B-1 GiB", worst("nccl-sendrecv", "vs_nccl"), 1.0)
    # The small sizes again, stream-ordered (FLAGCX_P2P_STREAM=on), beside the default paths'.
    for issue, t in [("#16", "sendrecv"), ("#19", "alltoall"), ("#19", "allgather"), ("#19", "broadcast")]:
        for name, how in [("nccl-", "default paths"), ("stream-", "FLAGCX_P2P_STREAM=on")]:
            verdict(issue, f"{t} busbw / NCCL's, 8 B-2 MiB, {how}", worst(name + t, "vs_nccl", high=2 * MIB), 1.0)
    # Late copies (FLAGCX_P2P_LATE_COPY=on) over the whole range.
    for issue, t in [("#16", "sendrecv"), ("#19", "alltoall"), ("#19", "allgather")]:
        verdict(issue, f"{t} busbw / NCCL's, 8 B-1 GiB, FLAGCX_P2P_LATE_COPY=on", worst("late-" + t, "vs_nccl"), 1.0)
    verdict("#17", "staged CUDA<->CUDA / pinned copy, from 64 MiB", worst("staged-pingpong", "ratio", 64 * MIB), 0.85)
    verdict("#17", "the same, FLAGCX_P2P_SPLIT=16", worst("staged-pingpong-split16", "ratio", 64 * MIB), 0.85)
    verdict("#17", "CUDA<->OpenCL / slower pinned copy, from 8 MiB", worst("ocl-pingpong", "ratio", 8 * MIB), 0.85)
    verdict("#17", "the same through host memory (FLAGCX_P2P_DEVICE_RING=off)", worst("ocl-pingpong-hostring", "ratio", 8 * MIB), 0.85)
    verdict("#17", "CUDA<->OpenCL 8 B sendrecv, us", worst("ocl-small", "time_us", pick=max), 60.0, higher_better=False, fmt="{:.1f}")
    for v in ["cuda-host", "cuda-opencl"]:
        p2p = {r["bytes"]: r for r in rows(d, f"mixed-{v}-sendrecv")}
        for t in ["allgather", "alltoall", "broadcast"]:
            # Like with like: a size counts where both took the same path, and one path only
            # (a host rank's buffer takes the ring while its registration runs, ~0.5 ms/MiB).
            coll = rows(d, f"mixed-{v}-{t}")
            same = [(r, p2p[r["bytes"]]) for r in coll if r["bytes"] in p2p
                    and r["path"] == p2p[r["bytes"]]["path"] != "mixed" and p2p[r["bytes"]]["busbw_gbs"] > 0]
            ratios = [r["busbw_gbs"] / q["busbw_gbs"] for r, q in same]
            verdict("#19", f"{v} {t} busbw / the pair's sendrecv, from 64 MiB ({len(same)} of {len(coll)} sizes)",
                    min(ratios) if ratios else None, 0.85)
    log = ""
    if os.path.exists(os.path.join(d, "port.log")):
        with open(os.path.join(d, "port.log")) as f:
            log = f.read()

    def num(pattern):
        m = re.search(pattern, log)
        return float(m.group(1)) if m else None

    pick, echo = num(r"port pick-up: ([0-9.]+) us"), num(r"bus echo: ([0-9.]+) us")
    one_way = pick - echo / 2 if pick is not None and echo is not None else None
    verdict("#23", "trigger pick-up, one way (round trip less half the bus echo), us", one_way, 2.0, higher_better=False)
    verdict("#23", "put_with_signal + wait ping-pong 8 B, round trip, us", num(r"port pingpong 8 B: ([0-9.]+) us"), 15.0, higher_better=False, fmt="{:.1f}")
    verdict("#23", "put_value_with_signal ping-pong 8 B, round trip, us", num(r"port pingpong 8 B value: ([0-9.]+) us"), 15.0, higher_better=False, fmt="{:.1f}")
    verdict("#23", "4 MiB puts / host-issued copies into the peer", num(r"into the peer [0-9.]+ GB/s; ratio ([0-9.]+) \(medians"), 0.9)
    placement = re.search(r"port: (rank 0 on .*?), (IPC|staged)", log)
    print()
    # No target of its own: whether the root's local copy is what keeps broadcast below NCCL
    # (in place: no local copy; rooted at 1 and pulled: the copies on different GPUs).
    bcast = [("out of place", "nccl-broadcast"), ("in place", "bcast-inplace"),
             ("root 1", "bcast-root1"), ("root 1 pulled", "bcast-root1-pull"),
             ("local copy on the SMs", "bcast-copy-kernel"), ("every copy on the SMs", "copy-kernel-all-broadcast")]
    by_size = {}
    for label, name in bcast:
        for r in rows(d, name):
            if r["bytes"] >= 16 * MIB:
                by_size.setdefault(r["bytes"], []).append(f"{label} {r['busbw_gbs']:.1f}")
                if r.get("nccl_gbs"):
                    by_size[r["bytes"]].append(f"(NCCL {r['nccl_gbs']:.1f})")
    for size, cells in sorted(by_size.items()):
        print(f"broadcast {size >> 20} MiB, GB/s: " + ", ".join(cells))
    # Every copy on the SMs: sendrecv beside NCCL, from 16 MiB (the engines' row is nccl-sendrecv).
    for r in rows(d, "copy-kernel-all-sendrecv"):
        if r["bytes"] >= 16 * MIB and r.get("vs_nccl") is not None:
            print(f"sendrecv {r['bytes'] >> 20} MiB, copies on the SMs: {r['busbw_gbs']:.1f} GB/s, {r['vs_nccl']:.2f} of NCCL")
    print("port channel placement: " + (placement.group(1) if placement else "unknown"))
    print(f"wrong bytes over every flagcx-perf row: {wrong}")
    w = [max(len(r[i]) for r in out) for i in range(4)]
    for r in out:
        print(f"{r[0]:<4} {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:<{w[3]}}  {r[4]}")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
