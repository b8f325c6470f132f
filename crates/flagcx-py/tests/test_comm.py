"""The package over numpy buffers: host ranks, OpenCL (PoCL) ranks and mixed pairs."""

import signal
import time

import pytest

from conftest import finish, run_job, start_job, vendor_or_skip

import flagcx

# PoCL (CI's OpenCL) reduces no float64 exactly; the dtypes case then expects the typed error.
NO_F64 = {"FLAGCX_TEST_NO_F64": "1"}


def test_module_surface():
    assert "host" in flagcx.vendors()
    assert flagcx.unique_id().startswith("fx1-")
    assert flagcx.unique_id() != flagcx.unique_id()
    assert "vendors" in flagcx.version()
    with pytest.raises(flagcx.InvalidArgument):
        flagcx.Comm(2, 2, flagcx.unique_id())
    with pytest.raises(flagcx.FlagcxError):
        flagcx.Comm(0, 1, "not-an-id")


def test_one_rank_job():
    import numpy as np

    with flagcx.Comm(0, 1, flagcx.unique_id(), vendor="host") as c:
        x = np.arange(5, dtype=np.float32)
        c.all_reduce(x)
        assert np.array_equal(x, np.arange(5, dtype=np.float32))
        c.barrier()
    with pytest.raises(flagcx.Aborted):
        c.all_reduce(x)


@pytest.mark.parametrize("case", ["collectives", "point_to_point", "dtypes", "bad_arguments",
                                  "host_memory_in_place"])
@pytest.mark.parametrize("n", [2, 3])
def test_host_ranks(case, n):
    run_job(case, ["host"] * n)


@pytest.mark.parametrize("case", ["collectives", "point_to_point"])
def test_staged_host_ranks(case):
    run_job(case, ["host"] * 2, env={"FLAGCX_P2P_DISABLE": "1"})


@pytest.mark.parametrize("case", ["collectives", "point_to_point", "dtypes"])
def test_host_and_opencl(case):
    vendor_or_skip("opencl")
    run_job(case, ["host", "opencl"], env=NO_F64)


@pytest.mark.parametrize("case", ["collectives", "point_to_point"])
def test_opencl_pair(case):
    vendor_or_skip("opencl")
    run_job(case, ["opencl", "opencl"], env=NO_F64)


def test_logs_reach_python_logging():
    run_job("logs", ["host"] * 2)


def test_a_dead_peer_raises_on_the_others():
    results = finish(start_job("ranks.py", ["peer_dies"], ["host"] * 3,
                               {"FLAGCX_TIMEOUT_MS": "5000"}), timeout=120)
    for rank in (0, 1):
        rc, text = results[rank]
        assert rc == 0 and f"rank {rank}: OK" in text, text
        assert "after" in text, text


def test_ctrl_c_ends_a_blocked_receive():
    procs = start_job("ranks.py", ["interrupt"], ["host"] * 2)
    line = ""
    t0 = time.monotonic()
    while "READY" not in line and time.monotonic() - t0 < 60:
        line = procs[0].stdout.readline()
        if not line and procs[0].poll() is not None:
            break
    assert "READY" in line
    time.sleep(0.5)
    procs[0].send_signal(signal.SIGINT)
    t_sig = time.monotonic()
    rc, text = finish(procs[:1], timeout=30)[0]
    waited = time.monotonic() - t_sig
    procs[1].kill()
    finish(procs[1:], timeout=30)
    assert "INTERRUPTED" in text and rc == 0, text
    assert waited < 5, f"^C took {waited:.1f} s to end the receive"


def test_stubs_match_the_module():
    """The .pyi names every class, function and Comm method the module has, and no more."""
    import ast
    from pathlib import Path

    from flagcx import _flagcx

    stub = ast.parse((Path(flagcx.__file__).parent / "_flagcx.pyi").read_text())
    top = {n.name for n in stub.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    public = {n for n in dir(_flagcx) if not n.startswith("_")}
    assert top == public, (top ^ public)
    comm = next(n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "Comm")
    methods = {n.name for n in comm.body if isinstance(n, ast.FunctionDef)}
    real = {n for n in dir(_flagcx.Comm) if not n.startswith("_") or n in ("__enter__", "__exit__")}
    real.add("__init__")
    assert methods == real, (methods ^ real)
    for name in public:
        assert getattr(_flagcx, name).__doc__, f"{name} has no docstring"
