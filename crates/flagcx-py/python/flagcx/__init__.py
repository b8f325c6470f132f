"""flagcx: move tensors between processes, whatever device runtime each process uses.

A :class:`Comm` is this process as one rank of a job. Its calls take numpy arrays, torch
tensors (CPU and CUDA), CuPy arrays or any object with ``__dlpack__``, and run on the rank's
device: the host vendor (CPU ranks), CUDA, or OpenCL. Ranks of different vendors exchange data
in one job. Host buffers are used in place on host-vendor ranks (registered for the call);
where a GPU or OpenCL device cannot use them, they are staged through device memory;
:meth:`Comm.empty` gives memory every call uses in place.

Quick start (two ranks, started by ``flagcx-run -n 2 python3 script.py``, ``torchrun`` or
``mpirun``)::

    import numpy as np, flagcx
    with flagcx.Comm.from_env() as comm:
        x = np.full(4, comm.rank + 1, dtype=np.float32)
        comm.all_reduce(x)            # in place; every rank now holds [3, 3, 3, 3]

Errors are exceptions derived from :class:`FlagcxError` (:class:`PeerLost`, :class:`Timeout`,
...). Library logs go to Python's ``logging`` under the loggers ``flagcx_p2p`` and ``flagcx``
(info and above; ``FLAGCX_DEBUG=debug`` or ``trace`` for more); call :func:`reset_logging` after
changing their levels.
"""

from ._flagcx import (
    Aborted,
    BootstrapError,
    Comm,
    ConfigError,
    DeviceError,
    FlagcxError,
    Group,
    InvalidArgument,
    Memory,
    OutOfMemory,
    PeerLost,
    ProtocolError,
    RemoteFailure,
    SizeMismatch,
    Timeout,
    Unavailable,
    Unsupported,
    Work,
    device_count,
    reset_logging,
    unique_id,
    vendors,
    version,
)

__all__ = [
    "Aborted",
    "BootstrapError",
    "Comm",
    "ConfigError",
    "DeviceError",
    "FlagcxError",
    "Group",
    "InvalidArgument",
    "Memory",
    "OutOfMemory",
    "PeerLost",
    "ProtocolError",
    "RemoteFailure",
    "SizeMismatch",
    "Timeout",
    "Unavailable",
    "Unsupported",
    "Work",
    "device_count",
    "empty",
    "from_store",
    "reset_logging",
    "unique_id",
    "vendors",
    "version",
]


def from_store(store, rank, nranks, key="flagcx/unique_id", vendor=None, device=None):
    """Joins a job through a key-value store every rank reaches (a ``torch.distributed``
    ``Store``, or any object with ``set(key, value)`` and a blocking ``get(key)``).

    Rank 0 makes the job's unique id and sets ``key``; the other ranks get it. ``vendor``
    and ``device`` as for :class:`Comm`. Use a different ``key`` per communicator.
    """
    if rank == 0:
        uid = unique_id()
        store.set(key, uid)
    else:
        uid = store.get(key)
        if isinstance(uid, (bytes, bytearray)):
            uid = uid.decode()
    return Comm(rank, nranks, uid, vendor=vendor, device=device)


def empty(comm, shape, dtype="float32", like="numpy"):
    """An array of ``shape`` and ``dtype`` in ``comm``'s device memory (zeroed), which every
    call uses in place with no staging copy: a numpy array (``like="numpy"``, host-vendor
    ranks) or a torch tensor (``like="torch"``; CPU on host-vendor ranks, CUDA on CUDA ranks).
    The memory lives as long as the array does.
    """
    if isinstance(shape, int):
        shape = (shape,)
    count = 1
    for d in shape:
        count *= int(d)
    if like == "numpy":
        import numpy as np

        dt = np.dtype(dtype)
        raw = np.from_dlpack(comm.empty(max(count * dt.itemsize, 1)))
        return raw[: count * dt.itemsize].view(dt).reshape(shape)
    if like == "torch":
        import torch

        dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        size = torch.empty((), dtype=dt).element_size()
        raw = torch.from_dlpack(comm.empty(max(count * size, 1)))
        return raw[: count * size].view(dt).reshape(shape)
    raise ValueError(f"like={like!r}: 'numpy' or 'torch'")
