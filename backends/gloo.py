"""Gloo backend: torch's ProcessGroupGloo on a store bootstrapped by MCR-DL.

MCR-DL does not touch the user's default torch process group. The world's store is a
``TCPStore`` that rank 0 opens on a free port and announces through the bootstrap
(under ``mpiexec``), or the one ``torchrun`` already runs on MASTER_ADDR:MASTER_PORT.
Each group gets its own ProcessGroupGloo on a ``PrefixStore``; creating it is a
rendezvous that can only block, so it runs on a helper thread while the calling thread
keeps driving the progress loop (in-flight MPI work keeps moving meanwhile).

All ops map to one Gloo call on flat views of the buffers (zero-copy):
``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base`` (uneven splits), and
gather/scatter with views of one flat staging buffer. ReduceOp.AVG is done as SUM then
a division on completion, the same on every dtype, so results do not depend on
whether a given torch build's Gloo knows AVG.

CUDA buffers (CuPy required). torch's Gloo handles CUDA tensors itself for broadcast
and all-reduce (torch's documentation table; it copies through pinned memory on side
streams that wait on torch's current stream, and its ``wait()`` makes the current
stream wait on the copies back). Those two ops (all-reduce: not AVG, not bfloat16) are
issued with the producer stream made torch's current stream, the completion hook runs
on that stream too, and the Work completes when an event recorded there after it is
done (queried from the progress loop). Every other op, and those exceptions, are staged
through pinned host memory by ``mcrdl_core.memory.cuda.staged_call``.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import datetime
import functools
import os
import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from mcrdl_core.world import bootstrap as _bootstrap
from mcrdl_core.base import config as _config
from mcrdl_core.memory import cuda as _cuda
from mcrdl_core import dtypes as dt
from mcrdl_core.world.backend import Backend
from mcrdl_core.world.group import next_round
from mcrdl_core.memory.buffer import Buffer
from mcrdl_core.base.ops import Op, ReduceOp
from mcrdl_core.engine.work import ChainWork, EventWork, ThreadWork, Work

_gpu = _cuda.cuda_dispatch

_TORCH = {dt.float16: torch.float16, dt.bfloat16: torch.bfloat16, dt.float32: torch.float32,
          dt.float64: torch.float64, dt.int8: torch.int8, dt.uint8: torch.uint8,
          dt.int16: torch.int16, dt.int32: torch.int32, dt.int64: torch.int64}
_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.SUM,
        ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT, ReduceOp.MIN: dist.ReduceOp.MIN,
        ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.BAND: dist.ReduceOp.BAND,
        ReduceOp.BOR: dist.ReduceOp.BOR, ReduceOp.BXOR: dist.ReduceOp.BXOR}


#: seconds by which Gloo's own timeouts (its store's, its process groups') outlast
#: MCR-DL's (``MCRDL_TIMEOUT``). With equal timeouts a peer that never comes raised
#: either MCR-DL's CommTimeoutError (naming op, group, backend and rank) or Gloo's
#: error, by chance (a fault test failed so). With Gloo's later, MCR-DL's diagnosis
#: always comes first; a helper thread still inside Gloo then returns this long after
#: the fault, well within the grace ``mcrdl_core.engine.faults`` gives it (5 s by default).
GLOO_TIMEOUT_MARGIN_S = 1.0


def _timeout(seconds: float) -> datetime.timedelta:
    """Gloo's timeout for MCR-DL's timeout ``seconds`` (see GLOO_TIMEOUT_MARGIN_S)."""
    return datetime.timedelta(seconds=seconds + GLOO_TIMEOUT_MARGIN_S)


def group_timeout(engine, group) -> float:
    """The timeout, in seconds, of a wait on ``group``'s work that names none: the
    group's own (``Group.timeout``: a torch group's ``timeout=``, ``new_group(timeout=)``)
    where set, else the runtime's (``MCRDL_TIMEOUT``, ``init_process_group(timeout=)``),
    as the progress engine judges (``timeout_of``). A group's Gloo process group times
    out ``GLOO_TIMEOUT_MARGIN_S`` after it, never before: a group whose own timeout is
    longer than ``MCRDL_TIMEOUT`` keeps it on Gloo too."""
    return engine.timeout if group.timeout is None else group.timeout


def tensor(buf: Buffer) -> torch.Tensor:
    """Flat torch view of a contiguous Buffer (no copy). Read-only inputs (a JAX array's
    memory, an XLA callback's operands) are viewed too: Gloo only reads inputs, and the
    core refuses read-only outputs before anything gets here."""
    if buf.device.kind == "cuda":
        return _cuda_tensor(buf)
    h = buf.host().reshape(-1)
    if not h.flags.writeable:
        with warnings.catch_warnings():  # torch warns once about non-writable arrays
            warnings.simplefilter("ignore", UserWarning)
            return tensor_of(h, buf.dtype)
    return tensor_of(h, buf.dtype)


def tensor_of(h: np.ndarray, dtype) -> torch.Tensor:
    if dtype is dt.bfloat16:
        return torch.from_numpy(h.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(h)


def _cuda_tensor(buf: Buffer) -> torch.Tensor:
    """Flat torch view of a contiguous CUDA Buffer: a slice of the torch tensor behind it
    when there is one, else through DLPack from the CuPy view."""
    owner = _cuda.root_owner(buf)
    if (isinstance(owner, torch.Tensor) and owner.is_contiguous()
            and owner.dtype is _TORCH.get(buf.dtype)):
        off, rem = divmod(buf.ptr - owner.data_ptr(), buf.dtype.itemsize)
        if not rem and 0 <= off and off + buf.numel <= owner.numel():
            return owner.detach().view(-1)[off:off + buf.numel]
    t = torch.from_dlpack(buf.cuda().reshape(-1))
    return t.view(torch.bfloat16) if buf.dtype is dt.bfloat16 else t


def env_store(bootstrap):
    """The torchrun store (MASTER_ADDR:MASTER_PORT), as a client of torchrun's agent
    store when torchrun hosts one, else hosted by rank 0. Used by the env bootstrap.

    Where torch's default group already runs (``init_process_group("gloo")`` first, then
    ``mcrdl_core.init()``), its store is shared instead: under a launch without an agent
    store (RANK/WORLD_SIZE/MASTER_* set by hand) torch's rank 0 already serves
    MASTER_PORT, and a second server there fails (EADDRINUSE) and leaves the others
    talking to a store whose peer is gone."""
    if dist.is_initialized():
        return dist.PrefixStore(_bootstrap.store_prefix(),
                                dist.distributed_c10d._get_default_store())
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    timeout = _config.get("MCRDL_TIMEOUT")
    store = dist.TCPStore(host, port, bootstrap.size, is_master=bootstrap.rank == 0 and not agent,
                          timeout=_timeout(timeout), wait_for_workers=False)
    return dist.PrefixStore(_bootstrap.store_prefix(), store)


class _Held:
    """The torch tensors of finished Gloo works, held until Gloo's worker thread has let
    go of the work.

    Why: torch's Gloo thread drops its own reference to a work a moment after marking it
    done. A tensor whose Python object loses its last Python reference while a C++ owner
    remains is kept alive by torch, and the last C++ owner then frees the Python object,
    which needs the GIL. When that owner is Gloo's thread and the interpreter is in its
    final teardown, asking for the GIL ends the thread on the spot, inside a destructor
    that may not throw: the process aborts ("terminate called without an active
    exception", SIGABRT) after the job succeeded. Seen under gdb at 2 ranks (8 of 40
    launches): ``~AsyncWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
    ``pthread_exit`` -> ``std::terminate``. The views this backend makes have no other
    C++ owner, so a held entry is let go once each of its tensors has a use count of 1
    (its Python object alone), checked whenever a Gloo work finishes or is made; the
    holder keeps at most ``CAP`` entries (letting the oldest go early, which only
    costs Gloo's thread a GIL round trip while the interpreter is whole). So the views
    of the last Gloo work, and the memory they reach, may live until the next Gloo call
    of the process (or its exit), not only until its ``wait()``. At exit
    (``drain``, an atexit handler: the interpreter is still whole) the rest are waited
    for up to ``EXIT_WAIT_S`` and whatever is still owned by Gloo is kept for good.
    """

    CAP = 256
    EXIT_WAIT_S = 2.0

    def __init__(self):
        self._q: collections.deque = collections.deque()
        self._lock = threading.Lock()

    @staticmethod
    def _free(entry) -> bool:
        return all(t._use_count() <= 1 for t in entry)

    def add(self, objs) -> None:
        entry = tuple(_tensors(objs))
        with self._lock:
            if entry:
                self._q.append(entry)
            self._sweep()

    def sweep(self) -> None:
        if self._q:
            with self._lock:
                self._sweep()

    def _sweep(self) -> None:
        q = self._q
        while q and (len(q) > self.CAP or self._free(q[0])):
            q.popleft()

    def __len__(self) -> int:
        return len(self._q)

    def drain(self, wait_s: float | None = None) -> int:
        """At exit: wait (up to ``wait_s``) for Gloo's threads to let go of the held
        works, then keep what is left alive for good. Returns how many were left."""
        deadline = time.monotonic() + (self.EXIT_WAIT_S if wait_s is None else wait_s)
        while True:
            with self._lock:
                self._q = collections.deque(e for e in self._q if not self._free(e))
                left = list(self._q)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        for entry in left:  # never freed: Gloo's thread then never needs the GIL for them
            for t in entry:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))
        return len(left)


def _tensors(objs):
    for o in objs:
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, (list, tuple)):
            yield from _tensors(o)


#: one per process: every Gloo work of every group hands its tensors here when it ends
_HELD = _Held()
if not hasattr(torch.Tensor, "_use_count"):  # an older torch: hold the last CAP, keep at exit
    _Held._free = staticmethod(lambda entry: False)
atexit.register(_HELD.drain)


class GlooWork(Work):
    """A torch Gloo work. Polled by ``is_completed()``; ``block`` lets a wait on Gloo
    alone sleep until Gloo's thread finishes it instead of polling."""

    poll_group = "gloo"

    def __init__(self, op, group, twork, keep=(), finalize=None, desc=""):
        super().__init__("gloo", op, group, finalize=finalize, desc=desc)
        self.twork = twork
        self.keep = keep
        self.on_stream = contextlib.nullcontext  # CUDA: makes the producer stream current

    def complete(self, error: BaseException | None = None) -> None:
        keep = self.keep
        super().complete(error)
        if keep and self.done:  # Gloo's thread may still hold the work: see _Held
            _HELD.add(keep)

    def poll(self) -> bool:
        if not self.twork.is_completed():
            return False
        with self.on_stream():  # CUDA works: the current stream waits on Gloo's copies back
            self.twork.wait()  # returns at once; raises the library's error if it failed
        return True

    def block(self, seconds: float) -> None:
        """Wait up to ``seconds`` inside torch (GIL released), returning when Gloo's
        thread completes the work. What the progress loop does while only such works
        are in flight: polling instead keeps a core busy that the ranks sharing it need,
        and its naps (up to 1 ms) see completion late. torch's timed wait raises when
        the time is up and leaves the work running; a failure is raised by the next
        ``poll``. (Not a callback on the work's future: Gloo's thread would then need
        the GIL, even when it fails an abandoned work while the interpreter exits.)"""
        try:
            with self.on_stream():
                self.twork.wait(datetime.timedelta(seconds=seconds))
        except RuntimeError:  # "Operation timed out!", or the work failed: poll tells
            pass


def _avg(buf: Buffer, n: int):
    def fin():
        h = buf.host()
        np.divide(h, n, out=h, casting="unsafe")
    return fin


class GlooBackend(Backend):
    name = "gloo"
    devices = ("cpu", "cuda")

    def __init__(self, runtime):
        super().__init__(runtime)
        self._stores: dict = {}  # member ranks -> store (MPI bootstrap)
        self._timeouts: dict = {}  # id(Gloo group) -> the timeout (s) it was last given

    @classmethod
    def unavailable_reason(cls, bootstrap):
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no Gloo support"
        return None

    def unsupported_reason(self, op, device, dtype, reduce_op=None):
        if dtype not in _TORCH:
            return f"the gloo backend cannot communicate {dtype.name}"
        if device.kind == "cuda":
            reason = _cuda.cupy_reason()
            if reason is not None:
                return f"the gloo backend needs CuPy for CUDA buffers: {reason}"
            if not torch.cuda.is_available():
                return "the gloo backend needs a CUDA build of torch for CUDA buffers"
        elif device.kind != "cpu":
            return f"the gloo backend does not handle {device.kind} buffers"
        return None

    # --- CUDA buffers -------------------------------------------------------------------
    def cuda_call(self, op, fn, group, args):
        """Gloo's own CUDA path for broadcast and all-reduce, staging for the rest."""
        red = next((a for a in args if isinstance(a, ReduceOp)), None)
        buf = args[0]
        if op is Op.BROADCAST or (op is Op.ALL_REDUCE and red is not ReduceOp.AVG
                                  and buf.dtype is not dt.bfloat16):
            return self._native_cuda(op, fn, group, args)
        return _cuda.staged_call(self.rt.engine, self.name, op, functools.partial(fn, self),
                                 group, *args)

    def _native_cuda(self, op, fn, group, args):
        buf = args[0]
        dev, handle = buf.device.index, _cuda.producer_stream(buf)
        ts = (torch.cuda.default_stream(dev) if handle == 0
              else torch.cuda.ExternalStream(handle, device=dev))

        @contextlib.contextmanager
        def on_stream():
            with torch.cuda.device(dev), torch.cuda.stream(ts):
                yield

        with on_stream():  # Gloo's copies to host wait on torch's current stream: ours
            work = fn(self, group, *args)
        work.on_stream = on_stream
        return ChainWork(work, lambda: EventWork(
            self.name, op, _cuda.record(handle, dev), group, keep=(buf,),
            desc="waiting for Gloo's copy back to the GPU"))

    # --- store and process groups -------------------------------------------------------
    def store(self, group=None):
        """The store the Gloo groups rendezvous on. Under torchrun (or a torch launch),
        the bootstrap's. Under MPI, a TCPStore hosted by the group's first member, whose
        address goes to the members only (``group_bcast``): a group made by its members
        only never waits for the rest of the world. The world's is kept for later groups
        that every rank makes."""
        bs = self.rt.bootstrap
        if bs.kind == "env":
            return bs.store
        ranks = tuple(range(bs.size)) if group is None else group.ranks
        st = self._stores.get(ranks)
        if st is None:
            timeout = _timeout(self.rt.engine.timeout)
            if bs.all_local:
                host = "127.0.0.1"
            elif ranks[0] == 0 and os.environ.get("MASTER_ADDR"):
                host = os.environ["MASTER_ADDR"]  # rank 0's address, as its launcher knows it
            else:  # the first member hosts the store: its own name, not rank 0's address
                host = bs.hostname()
            if bs.rank == ranks[0]:
                store = dist.TCPStore(host, 0, len(ranks), is_master=True, timeout=timeout,
                                      wait_for_workers=False)
                bs.group_bcast((host, store.port), ranks)
            else:
                host, port = bs.group_bcast(None, ranks)
                store = dist.TCPStore(host, port, len(ranks), is_master=False, timeout=timeout)
            st = self._stores[ranks] = dist.PrefixStore("mcrdl", store)
        return st

    def _device(self):
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        if iface:
            return dist.ProcessGroupGloo.create_device(interface=iface.split(",")[0])
        if self.rt.bootstrap.all_local:
            return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        return dist.ProcessGroupGloo.create_default_device()

    def comm(self, group):
        """The group's ProcessGroupGloo (made once), its timeout brought up to date
        first: a group's timeout and the runtime's can change after it is made
        (``set_timeout``, a later ``init_process_group(timeout=)``), and Gloo must not
        give up before the engine does (``group_timeout``)."""
        pg = group.comms.get(self.name)
        if pg is None:
            pg = super().comm(group)
        secs = group_timeout(self.rt.engine, group)
        if self._timeouts.get(id(pg)) != secs:
            pg.set_timeout(_timeout(secs))
            self._timeouts[id(pg)] = secs
        return pg

    def create_comm(self, group):
        # a group key can come back (torch names its groups afresh after
        # destroy_process_group + init_process_group; a runtime made again): each
        # rendezvous of the same key and ranks gets its own prefix (next_round)
        n = next_round(("gloo", group.key, group.ranks))
        ranks = ",".join(map(str, group.ranks))
        store = dist.PrefixStore(f"g{group.key}/{ranks}/{n}", self.store(group))
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [self._device()]
        secs = group_timeout(self.rt.engine, group)
        opts._timeout = _timeout(secs)
        work = ThreadWork("gloo", "create process group",
                          lambda: dist.ProcessGroupGloo(store, group.rank, group.size, opts),
                          group, desc="rendezvous")
        self.rt.engine.wait([work])
        pg = work.result()
        self._timeouts[id(pg)] = secs
        return pg

    def destroy(self):
        for g in self.rt.groups:
            g.comms.pop(self.name, None)
        self._stores.clear()
        self._timeouts.clear()

    # --- helpers ------------------------------------------------------------------------
    def _work(self, op, group, twork, bufs, finalize=None, desc=""):
        _HELD.sweep()
        return GlooWork(op, group, twork, bufs, finalize, desc)

    @staticmethod
    def _waited(op, group, twork, keep, result=None, finalize=None, desc=""):
        """For Gloo works that only report completion from inside wait() (send, recv and
        reduce-scatter in torch 2.x): a helper thread waits (torch releases the GIL
        there) and the progress loop polls the thread like any other work."""
        def run():
            twork.wait()
            assert keep is not None  # buffers stay referenced until the data has landed
            return result() if result else None

        work = ThreadWork("gloo", op, run, group, desc=desc)
        if finalize:
            work.add_finalizer(finalize)
        work.add_finalizer(lambda: _HELD.add(keep))  # Gloo's thread may still hold it
        return work

    # --- point to point -----------------------------------------------------------------
    @_gpu(Op.SEND)
    def send(self, group, buf, dst, tag):
        t = tensor(buf)
        return self._waited(Op.SEND, group, self.comm(group).send([t], dst, tag), (buf, t),
                            desc=f"to group rank {dst}")

    @_gpu(Op.RECV)
    def recv(self, group, buf, src, tag):
        t = tensor(buf)
        pg = self.comm(group)
        tw = pg.recv_anysource([t], tag) if src is None else pg.recv([t], src, tag)
        return self._waited(Op.RECV, group, tw, (buf, t),
                            result=(lambda: tw._source_rank()) if src is None else (lambda: src),
                            desc=f"from group rank {'any' if src is None else src}")

    # --- collectives --------------------------------------------------------------------
    @_gpu(Op.BROADCAST)
    def broadcast(self, group, buf, root):
        t = tensor(buf)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self._work(Op.BROADCAST, group, self.comm(group).broadcast([t], opts), (buf, t))

    @_gpu(Op.REDUCE)
    def reduce(self, group, buf, root, op):
        t = tensor(buf)
        opts = dist.ReduceOptions()
        opts.rootRank, opts.rootTensor, opts.reduceOp = root, 0, _OPS[op]
        fin = _avg(buf, group.size) if op is ReduceOp.AVG and group.rank == root else None
        return self._work(Op.REDUCE, group, self.comm(group).reduce([t], opts), (buf, t), fin)

    @_gpu(Op.ALL_REDUCE)
    def all_reduce(self, group, buf, op):
        t = tensor(buf)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        fin = _avg(buf, group.size) if op is ReduceOp.AVG else None
        return self._work(Op.ALL_REDUCE, group, self.comm(group).allreduce([t], opts), (buf, t),
                          fin)

    @_gpu(Op.ALL_GATHER)
    def all_gather(self, group, out, inp):
        to, ti = tensor(out), tensor(inp)
        return self._work(Op.ALL_GATHER, group, self.comm(group)._allgather_base(to, ti),
                          (out, inp, to, ti))

    @_gpu(Op.REDUCE_SCATTER)
    def reduce_scatter(self, group, out, inp, op):
        to, ti = tensor(out), tensor(inp)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]
        fin = _avg(out, group.size) if op is ReduceOp.AVG else None
        tw = self.comm(group)._reduce_scatter_base(to, ti, opts)
        return self._waited(Op.REDUCE_SCATTER, group, tw, (out, inp, to, ti), finalize=fin)

    @_gpu(Op.ALL_TO_ALL)
    def all_to_all(self, group, out, inp, out_counts, in_counts, even=False):
        """``all_to_all_single(x, x)`` (input and output sharing memory, as torch allows)
        sends a copy of the input: Gloo's alltoall writes blocks it has yet to send
        and returned wrong blocks, with no error, on 3 ranks. Gloo's all-gather and
        reduce-scatter handle shared memory themselves (tests/mpi/test_inplace.py)."""
        to, ti = tensor(out), tensor(inp)
        (lo_o, hi_o), (lo_i, hi_i) = out.span(), inp.span()
        if out.nbytes and inp.nbytes and lo_o < hi_i and lo_i < hi_o:
            ti = ti.clone()
        tw = self.comm(group).alltoall_base(to, ti, [] if even else list(out_counts),
                                            [] if even else list(in_counts),
                                            dist.AllToAllOptions())
        return self._work(Op.ALL_TO_ALL, group, tw, (out, inp, to, ti))

    @_gpu(Op.GATHER)
    def gather(self, group, out, inp, root):
        ti = tensor(inp)
        outs = [list(tensor(out).view(group.size, -1).unbind(0))] if group.rank == root else []
        opts = dist.GatherOptions()
        opts.rootRank = root
        tw = self.comm(group).gather(outs, [ti], opts)
        return self._work(Op.GATHER, group, tw, (out, inp, ti, outs))

    @_gpu(Op.SCATTER)
    def scatter(self, group, out, inp, root):
        to = tensor(out)
        ins = [list(tensor(inp).view(group.size, -1).unbind(0))] if group.rank == root else []
        opts = dist.ScatterOptions()
        opts.rootRank = root
        tw = self.comm(group).scatter([to], ins, opts)
        return self._work(Op.SCATTER, group, tw, (out, inp, to, ins))

    def barrier(self, group):
        return self._work(Op.BARRIER, group, self.comm(group).barrier(dist.BarrierOptions()), ())
