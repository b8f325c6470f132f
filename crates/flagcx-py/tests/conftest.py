"""Starts multi-process jobs for the package's tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flagcx

HERE = Path(__file__).parent


def vendor_or_skip(vendor):
    """Skips the test (counted by pytest) where `vendor` has no device here."""
    try:
        flagcx.device_count(vendor)
    except flagcx.FlagcxError as e:
        pytest.skip(f"no {vendor} device: {e}")


def start_job(script, args, vendors, env=None):
    """Starts one process per entry of `vendors`, as ranks of one job."""
    uid, uid2 = flagcx.unique_id(), flagcx.unique_id()
    procs = []
    for rank, vendor in enumerate(vendors):
        e = dict(os.environ)
        e.update(
            FLAGCX_RANK=str(rank),
            FLAGCX_NRANKS=str(len(vendors)),
            FLAGCX_LOCAL_RANK=str(rank),
            FLAGCX_UNIQUE_ID=uid,
            FLAGCX_VENDOR=vendor,
            FLAGCX_UNIQUE_ID2=uid2,
            PYTHONUNBUFFERED="1",
        )
        e.update(env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / script), *args],
                cwd=str(HERE),
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def finish(procs, timeout=180):
    """Waits for every rank; returns [(returncode, output)]."""
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
            text += "\n[killed: the job ran past its timeout]"
        out.append((p.returncode, text))
    return out


def run_job(case, vendors, env=None, timeout=180, script="ranks.py", args=()):
    """Runs `case` of `script` on ranks of `vendors`; fails with every rank's output unless
    each exits 0 and says OK."""
    results = finish(start_job(script, [case, *args], vendors, env), timeout)
    bad = [
        (i, rc, text)
        for i, (rc, text) in enumerate(results)
        if rc != 0 or f"rank {i}: OK" not in text
    ]
    if bad:
        pytest.fail(
            "\n".join(f"--- rank {i} exited {rc}:\n{text}" for i, rc, text in bad),
            pytrace=False,
        )
    return [text for _, text in results]
