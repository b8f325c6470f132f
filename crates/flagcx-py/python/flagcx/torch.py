"""A ``torch.distributed`` backend over flagcx, for CPU and CUDA ranks in one job.

Importing this module registers the backend ``"flagcx"`` for the ``cpu`` and ``cuda``
devices::

    import torch.distributed as dist
    import flagcx.torch  # registers "flagcx"
    dist.init_process_group("flagcx")  # torchrun's environment, or rank=/world_size=/store=

Each rank opens one device: ``FLAGCX_VENDOR`` if set (``host`` for a CPU rank, ``cuda``), else
CUDA where ``torch.cuda.is_available()``, else the host vendor. A CPU rank and a CUDA rank of
one job exchange data (the library stages between the runtimes). A rank's tensors are its
device's: CUDA tensors on a CUDA rank (CPU tensors there are staged through device memory),
CPU tensors on a host rank.

Semantics follow NCCL's backend:

* CUDA tensors: an operation is enqueued on the stream current at the call, in order after
  the work already there; ``Work.wait()`` makes the stream current at that time wait for it
  (no host wait), and ``get_future()`` is a CUDA future completed on that stream.
* CPU tensors: the operation runs on the communicator's own stream; ``Work.wait()`` blocks
  (the GIL released) and raises the operation's failure; futures are completed by a
  completion thread. A one-tensor ``all_reduce``, ``broadcast`` or ``all_gather_into_tensor``
  of at most 64 KiB runs to the end inside the call (its failure raised there) and returns a
  finished Work: the latency of small calls is mostly dispatch.
* A watchdog thread polls the communicator's asynchronous error (a lost peer, a timeout,
  ``FLAGCX_TIMEOUT_MS``) and aborts it, so every rank's pending and later calls raise
  instead of hanging. ``destroy_process_group`` (``shutdown``) and ``abort`` free everything.

Reduction ops: SUM, AVG, PRODUCT, MIN, MAX. BAND, BOR, BXOR and PREMUL_SUM raise
:class:`flagcx.Unsupported`.
"""

import atexit
import os
import queue
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.utils.dlpack
from torch._C._distributed_c10d import Backend as _C10dBackend

import flagcx

__all__ = ["FlagcxBackend", "BACKEND_NAME"]

#: The name ``init_process_group`` takes.
BACKEND_NAME = "flagcx"

_RED = dist.ReduceOp.RedOpType
_OPS = {
    _RED.SUM: "sum",
    _RED.AVG: "avg",
    _RED.PRODUCT: "prod",
    _RED.MIN: "min",
    _RED.MAX: "max",
}


_to_dlpack = torch.utils.dlpack.to_dlpack


def _dl(t):
    """``t`` as a DLPack capsule (``None`` stays ``None``): the extension takes capsules as
    they are, which saves the two Python-level ``Tensor.__dlpack__`` calls per buffer. No
    stream handshake is needed: CUDA calls run on the stream current now, behind the work
    that made ``t``."""
    return None if t is None else _to_dlpack(t)


def _op_name(reduce_op):
    op = getattr(reduce_op, "op", reduce_op)
    try:
        return _OPS[op]
    except KeyError:
        name = getattr(op, "name", str(op))
        raise flagcx.Unsupported(
            f"flagcx backend: ReduceOp.{name} is not supported (SUM, AVG, PRODUCT, MIN and "
            "MAX are)"
        ) from None


def _seconds(timeout):
    """A torch timeout (``timedelta``; negative or zero: unset) in seconds, or ``None``."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout)
    return s if s > 0 else None


#: CPU collectives of at most this many bytes run to the end inside the call (the package's
#: blocking call) and return a finished Work: one crossing into the extension instead of a
#: request and its wait, and no Work bookkeeping (a one-rank ``dist.all_reduce``: 22.3 µs
#: before, 16.5 after, of which 6.4 are torch's dispatch to any Python backend). The bytes
#: take a few µs at this size, so an ``async_op=True`` caller loses little overlap; larger
#: calls stay asynchronous.
_BLOCKING_MAX = 64 << 10


class _Finished(dist.Work):
    """The Work of a call that already finished (see ``_BLOCKING_MAX``)."""

    def __init__(self, outputs):
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout=None):
        """Returns True: the operation finished inside the call."""
        return True

    def is_completed(self):
        """True."""
        return True

    def get_future(self):
        """A ``torch.futures.Future`` already completed with the list of result tensors."""
        fut = torch.futures.Future()
        fut.set_result(self._outputs)
        return fut


class _Work(dist.Work):
    """What a call returns: the flagcx operations it enqueued and its result tensors.

    ``wait()`` follows NCCL's meaning (see the module's doc); ``get_future()`` gives a future
    whose value is the list of result tensors (what DDP's reducer reads).
    """

    def __init__(self, backend, works, outputs, cuda_stream=None, after=None):
        super().__init__()
        self._backend = backend
        self._works = works
        self._outputs = outputs
        self._after = after  # runs once the operations finished (copies out of temporaries)
        self._event = None
        self._device = None
        self._stream = cuda_stream
        if cuda_stream is not None:
            self._device = cuda_stream.device
            self._event = torch.cuda.Event()
            self._event.record(cuda_stream)
        self._future = None
        self._lock = threading.Lock()
        self._done = False
        self._error = None

    def _finish(self, timeout=None):
        """Host side: waits for the operations (CPU), runs the epilogue once."""
        with self._lock:
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            try:
                if self._event is None:
                    for w in self._works:
                        w.wait(timeout)
                if self._after is not None:
                    self._after()
            except BaseException as e:  # noqa: BLE001 - kept for every later waiter
                self._error = e
                self._done = True
                self._backend._note(e)
                raise
            self._works = []
            self._done = True

    def wait(self, timeout=None):
        """Blocks until the operation finished (CPU), or orders the current CUDA stream after
        it; raises its failure. Returns True."""
        self._backend._raise_if_failed()
        if self._event is not None:
            # First the order, then the epilogue: its copies out of temporaries run on the
            # current stream, which must be behind the operation.
            torch.cuda.current_stream(self._device).wait_event(self._event)
        self._finish(_seconds(timeout))
        return True

    def get_future(self):
        """A ``torch.futures.Future`` completed with the list of result tensors."""
        with self._lock:
            if self._future is not None:
                return self._future
            if self._event is not None:
                fut = torch.futures.Future(devices=[self._device])
            else:
                fut = torch.futures.Future()
            self._future = fut
        if self._event is not None:
            # Completed now, while the operation's stream is current: the future records
            # its own event there and waiters synchronize with it, not with the host.
            with torch.cuda.stream(self._stream):
                self._finish()
                fut.set_result(self._outputs)
        else:
            self._backend._complete_later(self, fut)
        return fut

    def is_completed(self):
        """True once the operations finished."""
        if self._done:
            return True
        if self._event is not None:
            return self._event.query()
        return all(w.is_completed() for w in self._works)


def _base():
    """The class the backend subclasses: c10d's ``Backend`` where torch lets Python construct
    one (its ``PyBackend`` trampoline: per-device dispatch and ``batch_isend_irecv`` work),
    else ``ProcessGroup`` (torch 2.11's ``Backend`` has no constructor Python can call; a
    ``ProcessGroup`` subclass serves every collective, but ``batch_isend_irecv`` needs a
    per-device backend and is not available there). ``FLAGCX_TORCH_BASE=processgroup``
    forces the second (tests run both)."""
    if os.environ.get("FLAGCX_TORCH_BASE", "").lower() == "processgroup":
        return dist.ProcessGroup

    class _Probe(_C10dBackend):
        pass

    try:
        _Probe(0, 1)
    except TypeError:
        return dist.ProcessGroup
    return _C10dBackend


class FlagcxBackend(_base()):
    """The process group backend. ``torch.distributed`` makes one per group through
    :func:`_create`; each holds one :class:`flagcx.Comm` joined through the group's store."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._timeout = _seconds(timeout)
        vendor = os.environ.get("FLAGCX_VENDOR") or (
            "cuda" if torch.cuda.is_available() else "host"
        )
        device = None
        if vendor == "cuda" and torch.cuda.is_available():
            device = torch.cuda.current_device()
        self._comm = flagcx.from_store(store, rank, size, key="flagcx/unique_id",
                                       vendor=vendor, device=device)
        self._coalescing = None
        self._grouped = False
        self._failure = None
        self._queue = None
        self._threads = []
        self._stop = threading.Event()
        watchdog = threading.Thread(target=self._watch, name="flagcx-watchdog", daemon=True)
        watchdog.start()
        self._threads.append(watchdog)

    # ---- plumbing ----

    def getBackendName(self):
        """``"flagcx"``."""
        return BACKEND_NAME

    def _watch(self):
        while not self._stop.wait(0.1):
            comm = self._comm
            if comm is None:
                return
            try:
                err = comm.async_error()
            except flagcx.Aborted:
                return
            if err is not None:
                self._note(err)
                comm.abort()
                return

    def _note(self, err):
        if self._failure is None and isinstance(
            err, (flagcx.PeerLost, flagcx.Timeout, flagcx.RemoteFailure, flagcx.DeviceError)
        ):
            self._failure = err

    def _raise_if_failed(self):
        if self._failure is not None:
            raise flagcx.Aborted(
                f"flagcx backend: the communicator was aborted after: {self._failure}"
            ) from self._failure

    def _complete_later(self, work, fut):
        if self._queue is None:
            self._queue = queue.Queue()
            t = threading.Thread(target=self._completer, name="flagcx-completion", daemon=True)
            t.start()
            self._threads.append(t)
        self._queue.put((work, fut))

    def _completer(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, fut = item
            try:
                work._finish()
                fut.set_result(work._outputs)
            except BaseException as e:  # noqa: BLE001 - handed to the future's waiters
                fut.set_exception(e)

    def _kw(self, tensor):
        """The stream keyword for a call on ``tensor``: CUDA tensors run on the current
        stream."""
        if tensor.is_cuda:
            return torch.cuda.current_stream(tensor.device)
        return None

    def _run(self, tensors, outputs, post, after=None):
        """Posts ``post(stream_kw)`` (one or several flagcx calls) and wraps them in a Work.
        Inside a coalescing block the call is queued and the block's Work covers it."""
        self._raise_if_failed()
        stream = self._kw(tensors[0]) if tensors else None
        kw = {"async_op": True}
        if stream is not None:
            kw["stream"] = stream.cuda_stream
        if self._coalescing is not None:
            self._coalescing.append((post, kw, after, outputs, stream))
            return _Work(self, [], outputs)
        works = post(kw)
        if not isinstance(works, list):
            works = [works]
        return _Work(self, works, outputs, cuda_stream=stream, after=after)

    @staticmethod
    def _flat(t):
        if not t.is_contiguous():
            raise flagcx.InvalidArgument(
                "flagcx backend: tensors must be contiguous (call .contiguous())"
            )
        return t.detach()

    # ---- collectives ----

    def _fast(self, tensor):
        """Whether a one-tensor call on ``tensor`` can skip the general path: a CPU tensor,
        outside coalescing, no failure seen. (The hot path of small collectives: torch's own
        dispatch to a Python backend costs about 9 µs per call, so every µs here shows.)"""
        return (self._coalescing is None and self._failure is None and not tensor.is_cuda
                and self._comm is not None)

    def _blocking(self, outputs, call):
        """Runs ``call()`` (a blocking package call) and returns a finished Work; a failure is
        noted for the watchdog's later calls, as a Work's wait notes it."""
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - re-raised
            self._note(e)
            raise
        return _Finished(outputs)

    def allreduce(self, tensors, opts):
        """``dist.all_reduce``."""
        if len(tensors) == 1 and self._fast(tensors[0]):
            t = tensors[0]
            op = _OPS.get(opts.reduceOp.op) or _op_name(opts.reduceOp)
            if t.nbytes <= _BLOCKING_MAX:
                # `_blocking` written out: this is the hottest path of small training steps.
                try:
                    self._comm.all_reduce(_to_dlpack(t), op)
                except BaseException as e:  # noqa: BLE001 - re-raised
                    self._note(e)
                    raise
                return _Finished(tensors)
            return _Work(self, [self._comm.all_reduce(_to_dlpack(t), op, async_op=True)],
                         tensors)
        op = _op_name(opts.reduceOp)
        ts = [self._flat(t) for t in tensors]
        return self._run(ts, tensors, lambda kw: self._group(
            [lambda t=t: self._comm.all_reduce(_dl(t), op, **kw) for t in ts]))

    def allreduce_coalesced(self, tensors, opts):
        """``dist.all_reduce_coalesced`` and ``_coalescing_manager``: one group."""
        return self.allreduce(tensors, opts)

    def _group(self, calls):
        """Posts several calls as one flagcx group (inside a coalescing block's group, as
        part of that one: groups do not nest)."""
        if len(calls) == 1 or self._grouped:
            return [c() for c in calls]
        with self._comm.group():
            return [c() for c in calls]

    def reduce(self, tensors, opts):
        """``dist.reduce``."""
        op = _op_name(opts.reduceOp)
        t = self._flat(tensors[0])
        root = opts.rootRank
        return self._run([t], tensors, lambda kw: self._comm.reduce(_dl(t), root, op, **kw))

    def broadcast(self, tensors, opts):
        """``dist.broadcast``."""
        if len(tensors) == 1 and self._fast(tensors[0]):
            t, root = tensors[0], opts.rootRank
            if t.nbytes <= _BLOCKING_MAX:
                return self._blocking(tensors, lambda: self._comm.broadcast(_to_dlpack(t), root))
            w = self._comm.broadcast(_to_dlpack(t), root, async_op=True)
            return _Work(self, [w], tensors)
        ts = [self._flat(t) for t in tensors]
        root = opts.rootRank
        return self._run(ts, tensors, lambda kw: self._group(
            [lambda t=t: self._comm.broadcast(_dl(t), root, **kw) for t in ts]))

    def all_gather_single(self, output, input, opts):
        """``dist.all_gather_into_tensor`` / ``_all_gather_base``."""
        if self._fast(input):
            if output.nbytes <= _BLOCKING_MAX:
                return self._blocking([output], lambda: self._comm.all_gather(
                    _to_dlpack(input), _to_dlpack(output)))
            w = self._comm.all_gather(_to_dlpack(input), _to_dlpack(output), async_op=True)
            return _Work(self, [w], [output])
        o, i = self._flat(output), self._flat(input)
        return self._run([i], [output], lambda kw: self._comm.all_gather(_dl(i), _dl(o), **kw))

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        """``all_gather_into_tensor`` inside ``_coalescing_manager``."""
        pairs = [(self._flat(o), self._flat(i)) for o, i in zip(outputs, inputs)]
        return self._run([p[1] for p in pairs], outputs, lambda kw: self._group(
            [lambda p=p: self._comm.all_gather(_dl(p[1]), _dl(p[0]), **kw) for p in pairs]))

    def allgather(self, output_tensors, input_tensors, opts):
        """``dist.all_gather`` (a list of outputs): gathered into one tensor, then copied
        out."""
        i = self._flat(input_tensors[0])
        outs = output_tensors[0]
        tmp = torch.empty((len(outs),) + tuple(i.shape), dtype=i.dtype, device=i.device)

        def after():
            for k, o in enumerate(outs):
                o.copy_(tmp[k])

        return self._run([i], output_tensors, lambda kw: self._comm.all_gather(_dl(i), _dl(tmp), **kw),
                         after=after)

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        """``dist.all_gather_coalesced``."""
        works = [self.allgather([o], [i], opts) for o, i in zip(output_lists, input_tensors)]
        return _Chain(self, works, output_lists)

    def reduce_scatter_single(self, output, input, opts):
        """``dist.reduce_scatter_tensor`` / ``_reduce_scatter_base``."""
        op = _op_name(opts.reduceOp)
        o, i = self._flat(output), self._flat(input)
        return self._run([i], [output], lambda kw: self._comm.reduce_scatter(_dl(i), _dl(o), op, **kw))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        """``reduce_scatter_tensor`` inside ``_coalescing_manager``."""
        op = _op_name(opts.reduceOp)
        pairs = [(self._flat(o), self._flat(i)) for o, i in zip(outputs, inputs)]
        return self._run([p[1] for p in pairs], outputs, lambda kw: self._group(
            [lambda p=p: self._comm.reduce_scatter(_dl(p[1]), _dl(p[0]), op, **kw) for p in pairs]))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        """``dist.reduce_scatter`` (a list of inputs): packed into one tensor first."""
        op = _op_name(opts.reduceOp)
        o = self._flat(output_tensors[0])
        ins = input_tensors[0]
        tmp = torch.stack([t.detach() for t in ins]).contiguous()
        return self._run([tmp], output_tensors,
                         lambda kw: self._comm.reduce_scatter(_dl(tmp), _dl(o), op, **kw))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        """``dist.all_to_all_single`` (even, or uneven with split sizes along dim 0)."""
        o, i = self._flat(output), self._flat(input)
        if not output_split_sizes and not input_split_sizes:
            return self._run([i], [output], lambda kw: self._comm.all_to_all(_dl(i), _dl(o), **kw))
        n = self.size()
        row_i = i[0].numel() if i.dim() > 0 and i.shape[0] else 1
        row_o = o[0].numel() if o.dim() > 0 and o.shape[0] else 1
        ins = [s * row_i for s in input_split_sizes] or [i.numel() // n] * n
        outs = [s * row_o for s in output_split_sizes] or [o.numel() // n] * n
        return self._run([i], [output],
                         lambda kw: self._comm.all_to_all(_dl(i), _dl(o), ins, outs, **kw))

    def alltoall(self, output_tensors, input_tensors, opts):
        """``dist.all_to_all`` (lists): packed, exchanged with split sizes, copied out."""
        ref = input_tensors[0]
        flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=ref.dtype,
                               device=ref.device)
        ins = [t.numel() for t in input_tensors]
        outs = [t.numel() for t in output_tensors]

        def after():
            at = 0
            for t in output_tensors:
                t.copy_(flat_out[at:at + t.numel()].view_as(t))
                at += t.numel()

        return self._run([flat_in], output_tensors,
                         lambda kw: self._comm.all_to_all(_dl(flat_in), _dl(flat_out), ins, outs, **kw),
                         after=after)

    def gather(self, output_tensors, input_tensors, opts):
        """``dist.gather``: into one tensor on the root, then copied out."""
        i = self._flat(input_tensors[0])
        root = opts.rootRank
        if self.rank() == root:
            outs = output_tensors[0]
            tmp = torch.empty((len(outs),) + tuple(i.shape), dtype=i.dtype, device=i.device)

            def after():
                for k, o in enumerate(outs):
                    o.copy_(tmp[k])
        else:
            tmp, after = None, None
        return self._run([i], output_tensors,
                         lambda kw: self._comm.gather(_dl(i), _dl(tmp), root, **kw), after=after)

    def scatter(self, output_tensors, input_tensors, opts):
        """``dist.scatter``: the root's list packed into one tensor first."""
        o = self._flat(output_tensors[0])
        root = opts.rootRank
        tmp = None
        if self.rank() == root:
            tmp = torch.stack([t.detach() for t in input_tensors[0]]).contiguous()
        return self._run([o], output_tensors,
                         lambda kw: self._comm.scatter(_dl(tmp), _dl(o), root, **kw))

    def barrier(self, opts):
        """``dist.barrier``."""
        self._raise_if_failed()
        return _Work(self, [self._comm.barrier(async_op=True)], [])

    # ---- point to point ----

    def send(self, tensors, dstRank, tag):
        """``dist.send`` / ``isend`` (tags are not matched: messages pair in posting order)."""
        t = self._flat(tensors[0])
        return self._run([t], tensors, lambda kw: self._comm.send(_dl(t), dstRank, **kw))

    def recv(self, tensors, srcRank, tag):
        """``dist.recv`` / ``irecv`` from ``srcRank``."""
        t = self._flat(tensors[0])
        return self._run([t], tensors, lambda kw: self._comm.recv(_dl(t), srcRank, **kw))

    # The names older torch looks up (2.11's ProcessGroup trampoline, and torch.distributed's
    # own calls such as ``group._allgather_base``): without them a ProcessGroup subclass falls
    # through to C++, which finds no backend for the device.
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    @property
    def supports_coalescing(self):
        """True: ``batch_isend_irecv`` posts its operations as one flagcx group."""
        return True

    def start_coalescing(self, device=None):
        """Opens a coalescing block: calls until ``end_coalescing`` are posted together."""
        self._coalescing = []

    def _start_coalescing(self, device=None):
        """``_coalescing_manager``'s entry where this backend is the ProcessGroup itself
        (``FLAGCX_TORCH_BASE=processgroup``, or torch without a Python-constructible Backend):
        torch's own method there looks for a per-device backend (torch 2.11: "No backend type
        associated with device type cuda")."""
        self.start_coalescing(device)

    def _end_coalescing(self, device=None):
        """``_coalescing_manager``'s exit where this backend is the ProcessGroup itself: the
        block's calls as one group, one Work."""
        return self.end_coalescing(device)

    def end_coalescing(self, device=None):
        """Posts the block's calls in one flagcx group; one Work for all of them."""
        calls, self._coalescing = self._coalescing or [], None
        if not calls:
            return _Work(self, [], [])
        works, afters, outputs = [], [], []
        self._grouped = True
        try:
            with self._comm.group():
                works, afters, outputs = self._post_all(calls)
        finally:
            self._grouped = False
        stream = next((c[4] for c in calls if c[4] is not None), None)

        def after_all():
            for a in afters:
                a()

        return _Work(self, works, outputs, cuda_stream=stream,
                     after=after_all if afters else None)

    @staticmethod
    def _post_all(calls):
        works, afters, outputs = [], [], []
        for post, kw, after, outs, _ in calls:
            w = post(kw)
            works.extend(w if isinstance(w, list) else [w])
            if after is not None:
                afters.append(after)
            outputs.extend(outs)
        return works, afters, outputs

    # ---- teardown ----

    def shutdown(self):
        """``destroy_process_group``: stops the threads and frees the communicator."""
        self._stop.set()
        if self._queue is not None:
            self._queue.put(None)
        # Joined, not left to the interpreter's exit: a daemon thread stopped there inside
        # the extension's code takes the process down with it.
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout=5)
        self._threads = []
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()
        _LIVE.discard(self)

    def abort(self):
        """Aborts the communicator: every rank's pending operations with this one fail."""
        comm = self._comm
        if comm is not None:
            comm.abort()
        self.shutdown()


class _Chain(_Work):
    """Several Works as one."""

    def __init__(self, backend, works, outputs):
        super().__init__(backend, [], outputs)
        self._parts = works

    def _finish(self, timeout=None):
        for w in self._parts:
            w._finish(timeout)

    def wait(self, timeout=None):
        for w in self._parts:
            w.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._parts)


#: Backends not shut down yet: shut down at exit (``destroy_process_group`` not called).
_LIVE = weakref.WeakSet()


@atexit.register
def _shutdown_all():
    for b in list(_LIVE):
        try:
            b.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _create(store, rank, size, timeout):
    b = FlagcxBackend(store, rank, size, timeout)
    _LIVE.add(b)
    return b


if not hasattr(dist.Backend, BACKEND_NAME.upper()):
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
