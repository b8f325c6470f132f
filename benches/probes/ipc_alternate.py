# Is a copy slow when two processes on one GPU take turns? Both sides copy 8 B into the other's
# memory (CUDA IPC), handing the turn over a pipe; compare with only one side using the GPU.
import multiprocessing as mp, time
def side(me, conn, hq_out, hq_in, res):
    import cupy as cp
    rt = cp.cuda.runtime
    mine = cp.zeros(1 << 20, dtype=cp.uint8)
    hq_out.put(bytes(rt.ipcGetMemHandle(mine.data.ptr)))
    peer = rt.ipcOpenMemHandle(hq_in.get())
    src = cp.ones(1 << 20, dtype=cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    def copy():
        rt.memcpyAsync(peer, src.data.ptr, 8, rt.memcpyDeviceToDevice, s.ptr); s.synchronize()
    out = {}
    for mode in ["pipe only", "one side copies", "both sides copy"]:
        n = 300
        for i in range(n + 20):
            if i == 20: t = time.perf_counter()
            if me == 0:
                if mode != "pipe only": copy()
                conn.send(1); conn.recv()
            else:
                conn.recv()
                if mode == "both sides copy": copy()
                conn.send(1)
        if me == 0: out[mode] = (time.perf_counter() - t) / n * 1e6
    if me == 0: res.put(out)
    conn.recv() if me == 1 else conn.send(0)
    rt.ipcCloseMemHandle(peer)
if __name__ == "__main__":
    mp.set_start_method("spawn")
    a, b = mp.Pipe(); q01, q10, res = mp.Queue(), mp.Queue(), mp.Queue()
    p0 = mp.Process(target=side, args=(0, a, q01, q10, res)); p1 = mp.Process(target=side, args=(1, b, q10, q01, res))
    p0.start(); p1.start()
    for k, v in res.get().items(): print(f"{k:>18}: {v:7.1f} us per round trip")
    p0.join(); p1.join()
