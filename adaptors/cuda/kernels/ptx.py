# Compiles a CUDA source to PTX with NVRTC (pip install nvidia-cuda-nvrtc-cu12; NVRTC=path to
# libnvrtc.so.12 if it is not found), for compute_75: python3 ptx.py stream.cu stream.ptx
# [extra NVRTC options, e.g. --fmad=false] (then lower the .version line to 7.0, see stream.cu).
import ctypes, sys, os
lib = ctypes.CDLL(os.environ.get("NVRTC", "/tmp/nvcc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
src = open(sys.argv[1]).read().encode()
prog = ctypes.c_void_p()
def ck(r, what):
    if r != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise SystemExit(f"{what}: {lib.nvrtcGetErrorString(r).decode()}")
ck(lib.nvrtcCreateProgram(ctypes.byref(prog), src, sys.argv[1].encode(), 0, None, None), "create")
opts = [b"--gpu-architecture=compute_75", b"-default-device"] + [a.encode() for a in sys.argv[3:]]
arr = (ctypes.c_char_p * len(opts))(*opts)
r = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log)
if log.value.strip(): print(log.value.decode(), file=sys.stderr)
ck(r, "compile")
lib.nvrtcGetPTXSize(prog, ctypes.byref(n)); ptx = ctypes.create_string_buffer(n.value); lib.nvrtcGetPTX(prog, ptx)
open(sys.argv[2], "w").write(ptx.value.decode())
