"""The torch backend on CPU ranks (torch from PyPI runs on CPU here)."""

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from conftest import finish, run_job, start_job  # noqa: E402

EXAMPLE = Path(__file__).parent.parent / "examples" / "ddp.py"


# The backend subclasses c10d's Backend where torch lets Python construct one, else
# ProcessGroup (torch 2.11): both are run here, the second forced.
BASES = {"backend": {}, "processgroup": {"FLAGCX_TORCH_BASE": "processgroup"}}


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("n", [2, 3])
def test_every_op_through_torch_distributed(n, base):
    run_job("ops", ["host"] * n, script="torch_ranks.py", env=BASES[base])


def test_results_read_at_once_while_a_peer_posts_late():
    run_job("late_peer", ["host"] * 2, script="torch_ranks.py")


@pytest.mark.parametrize("base", BASES)
def test_ddp_example_on_two_cpu_ranks(base):
    # Gradients and parameters bit-identical on every rank; losses as in one process.
    texts = run_job("--check", ["host"] * 2, script=str(EXAMPLE), args=("--steps", "15"),
                    env=BASES[base])
    assert "one-process losses agree" in texts[0], texts[0]


@pytest.mark.parametrize("case", ["peer_dies", "peer_dies_small"])
def test_a_dead_peer_fails_the_others(case):
    results = finish(start_job("torch_ranks.py", [case], ["host"] * 3,
                               {"FLAGCX_TIMEOUT_MS": "5000"}), timeout=120)
    for rank in (0, 1):
        rc, text = results[rank]
        assert rc == 0 and f"rank {rank}: OK" in text, text


def test_backend_registers_for_cpu_and_cuda():
    out = subprocess.run(
        [sys.executable, "-c",
         "import flagcx.torch, torch.distributed as dist;"
         "print(dist.Backend.FLAGCX, sorted(dist.Backend.backend_capability['flagcx']))"],
        capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["flagcx", "['cpu',", "'cuda']"], out.stdout
