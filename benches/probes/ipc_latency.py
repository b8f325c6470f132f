# Raw CUDA IPC copy latency between two processes on one GPU (CuPy), to separate what the
# hardware/driver costs from what flagcx-p2p adds.
import multiprocessing as mp, time, sys
def owner(q, done):
    import cupy as cp
    buf = cp.zeros(1 << 20, dtype=cp.uint8)
    q.put(bytes(cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr)))
    done.wait()
def user(q, done, out):
    import cupy as cp
    h = q.get()
    rt = cp.cuda.runtime
    peer = rt.ipcOpenMemHandle(h)
    local = cp.ones(1 << 20, dtype=cp.uint8)
    local2 = cp.zeros(1 << 20, dtype=cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    res = {}
    for name, dst in [("local d2d", local2.data.ptr), ("ipc d2d", peer)]:
        for n in [8, 4096, 65536]:
            for _ in range(20):
                rt.memcpyAsync(dst, local.data.ptr, n, rt.memcpyDeviceToDevice, s.ptr); s.synchronize()
            t = time.perf_counter()
            for _ in range(500):
                rt.memcpyAsync(dst, local.data.ptr, n, rt.memcpyDeviceToDevice, s.ptr); s.synchronize()
            res[(name, n)] = (time.perf_counter() - t) / 500 * 1e6
    # The same, with events polled (as the proxy does) instead of stream sync.
    ev = cp.cuda.Event(disable_timing=True)
    t = time.perf_counter()
    for _ in range(500):
        rt.memcpyAsync(peer, local.data.ptr, 8, rt.memcpyDeviceToDevice, s.ptr); ev.record(s)
        while not ev.done: pass
    res[("ipc d2d, event polled", 8)] = (time.perf_counter() - t) / 500 * 1e6
    out.put(res); rt.ipcCloseMemHandle(peer); done.set()
if __name__ == "__main__":
    mp.set_start_method("spawn")
    q, out, done = mp.Queue(), mp.Queue(), mp.Event()
    a = mp.Process(target=owner, args=(q, done)); a.start()
    b = mp.Process(target=user, args=(q, done, out)); b.start()
    for (name, n), us in sorted(out.get().items()):
        print(f"{name:>24} {n:>7} B: {us:8.1f} us per copy + sync")
    a.join(); b.join()
