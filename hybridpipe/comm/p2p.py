"""Point-to-point transport of structured values (a tensor, or tuples/lists/dicts of tensors).

This is how the pipeline moves activations forward and gradients backward. A value's **first message**
goes on tag ``tag``; the receiver posts its receive early into a buffer of :data:`MESSAGE_CAPACITY`
bytes, so it never needs to know shapes in advance and shapes may change from one step to the next.
Its first byte says what it holds:

* a plain tensor (the usual hop): a fixed binary header (:data:`_TENSOR`: dtype code, shape,
  ``requires_grad``), then, when its data is at most :data:`HEADER_CAPACITY` bytes, the data itself.
  One MPI message per hop, no pickling; the receiver's tensor is a view of the receive buffer. Larger
  tensors (and those a CUDA-aware MPI sends from device memory) follow as a payload message on
  ``tag + 1``;
* any other value (tuples/lists/dicts of tensors, non-tensor leaves such as ``None`` or ints): its
  structure with every tensor replaced by its shape, dtype and ``requires_grad``, pickled, with the
  tensors' bytes inside when they hold at most :data:`INLINE_BYTES` in all, else one payload message per
  tensor on ``tag + 1``;
* an error (below).

So a sender and receiver each consume two consecutive tags per message; callers use even tags.
Both directions go through the C++ core (``hybridpipe._C``), which releases the GIL
while waiting. After ``hp.init`` their MPI calls are made under the communication thread's lock (one
thread at a time in MPI, see docs/concepts.md): by the calling thread itself when that thread is not in
MPI, else by the communication thread, which also tests them in the background. Each request holds
its buffers until MPI is done with them (a one-message tensor is copied into the message first), so
dropping a :class:`Send` or :class:`Receive` in flight is safe. Tensors on a GPU are staged through host
memory unless the MPI library is CUDA-aware.

A stage that fails sends an **error message** on :data:`ERROR_TAG` to its neighbours; a receive
waiting with ``abort=`` on such an error raises :class:`RemoteError` instead of hanging.

Every wait is bounded and explained (:func:`_wait_any`): it also watches the departure notices of
ranks that called ``hp.shutdown`` (:mod:`hybridpipe.comm.departures`) and raises
:class:`~hybridpipe.errors.PeerShutDownError` when the rank it waits for has left; past
``stall_check_seconds`` it warns, naming the rank and what it waits for; past
``HYBRIDPIPE_TIMEOUT_SECONDS`` it raises :class:`~hybridpipe.errors.WaitTimeoutError`.
"""

from __future__ import annotations

import functools
import pickle
import socket
import struct
import sys
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..config import Config
from .. import running
from ..errors import PeerShutDownError, RanksLostError, RemoteError, WaitTimeoutError
from .._ext import core
from . import context
from . import device as devices
from .buffers import host_contiguous, raw_bytes
from .departures import FAILED

__all__ = ["HEADER_CAPACITY", "MESSAGE_CAPACITY", "ERROR_TAG", "RemoteError", "Send", "Receive", "send",
           "send_error", "receive_error", "forget"]

#: Largest pickled structure a first message may hold, and largest tensor data sent inside it (bytes).
HEADER_CAPACITY = 64 * 1024
#: Tag of error messages (the payload tag, ERROR_TAG + 1, is never used).
ERROR_TAG = 32000
#: Values whose tensors hold at most this many bytes in all travel inside the pickled first message: one
#: MPI message per value instead of 1 + tensors (small activations are latency-bound).
INLINE_BYTES = 32 * 1024
# First byte of a first message: a tensor with its data, a tensor whose data follows on tag + 1, a pickled
# structure, an error.
_TENSOR_INLINE, _TENSOR_APART, _PICKLED, _ERROR = b"T"[0], b"A"[0], b"P"[0], b"E"[0]
#: A tensor's header: kind, dtype code, number of dimensions, requires_grad, then the shape (64 bytes; the data
#: that follows it starts 64-byte aligned in the message).
_TENSOR = struct.Struct("<BBBB4x7q")
_MAX_DIMS = 7
_NO_DIMS = (0,) * _MAX_DIMS
#: Size of the buffer every first message is received into.
MESSAGE_CAPACITY = HEADER_CAPACITY + _TENSOR.size
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
#: How long a wait first waits in C++ alone, before the bounded wait's bookkeeping (:func:`_wait_any`) starts: a
#: neighbour's RemoteError or departure is noticed at most this much later, a hop's wait costs no Python.
FAST_WAIT_SECONDS = 0.02


class _Leaf:
    """A tensor in a value's structure: where it is among the value's tensors, its shape, dtype and requires_grad.
    (A plain class with slots: one is made per hop, a frozen dataclass takes three times as long.)"""

    __slots__ = ("index", "shape", "dtype", "requires_grad")

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool) -> None:
        self.index, self.shape, self.dtype, self.requires_grad = index, shape, dtype, requires_grad

    def __repr__(self) -> str:
        return f"_Leaf({self.index}, {self.shape}, {self.dtype}, requires_grad={self.requires_grad})"

    def __reduce__(self) -> tuple:  # a plain call, the dtype by name: a fifth of the default's pickling time
        return _leaf, (self.index, self.shape, str(self.dtype)[6:], self.requires_grad)


def _leaf(index: int, shape: tuple[int, ...], dtype: str, requires_grad: bool) -> _Leaf:
    return _Leaf(index, shape, getattr(torch, dtype), requires_grad)


def _skeleton(value: Any, leaves: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its :class:`_Leaf` (appended to ``leaves``)."""

    def describe(tensor: torch.Tensor) -> _Leaf:
        leaves.append(tensor)
        return _Leaf(len(leaves) - 1, tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:  # the usual hop: no tree walk
        return describe(value)
    return pytree.tree_map_only(torch.Tensor, describe, value)


def _rebuild(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if type(skeleton) is _Leaf:
        return tensors[skeleton.index]
    return pytree.tree_map_only(_Leaf, lambda leaf: tensors[leaf.index], skeleton)


def _leaves(skeleton: Any) -> list[_Leaf]:
    if type(skeleton) is _Leaf:
        return [skeleton]
    return sorted((leaf for leaf in pytree.tree_leaves(skeleton) if isinstance(leaf, _Leaf)),
                  key=lambda leaf: leaf.index)


def _wait_policy() -> tuple[Config, Any]:
    """How waits here block, and the settings that say so (with hp.init too: the waiting thread tests its transfers
    itself under the communication lock, or sleeps until the communication thread completes them): the
    configured polite wait (spin briefly, then sleep between tests), so that a stage waiting for its neighbour
    leaves the core to compute (HYBRIDPIPE_WAIT_SPIN_US). The running job's; outside a job, the environment's."""
    running = context.current_or_none()
    if running is not None:
        return running.config, running.wait
    config = Config.from_env()
    return config, context.wait_policy(config)


#: After a departure notice from the rank a wait is for, how long what it sent before it left may still
#: take to arrive (the notice travels on another communicator, which MPI may deliver first).
DEPARTURE_GRACE_SECONDS = 0.5

#: While hp.elastic.run survives failures: how long a failed transfer waits for the communication thread to record a
#: lost rank (it checks every 10 ms) before its error is taken as something else.
LOST_RANKS_GRACE_SECONDS = 2.0


def _peer(comm_f: int, rank: int, running: Any) -> tuple[str, int | None]:
    """How to name rank ``rank`` of the communicator ``comm_f`` in a message, and its world rank (None
    without hp.init)."""
    if running is None:
        return f"rank {rank} of the communicator", None
    world = running.departures.world_rank(comm_f, rank)
    if world is None:
        return f"rank {rank} of the communicator", None
    return f"rank {world} (stage {running.departures.stage_of(world)})", world


def _this_rank(running: Any, host: bool = False) -> str:
    where = [f"host {socket.gethostname()}"] if host else []
    if running is not None:
        where[:0] = [f"rank {running.grid.rank}", f"stage {running.grid.stage}"]
    return f"this rank ({', '.join(where)})" if where else "this rank"


def _raise_if_lost(error: RuntimeError, what: str) -> None:
    """Raises the :class:`RanksLostError` of ``error``, the failure of a transfer (``what``: what it posted or waited
    for), when the engine lost ranks (hp.elastic.run survives failures: it revoked the communicators and stopped the
    transfers), which hp.elastic.run recovers from; returns otherwise, for the caller to raise ``error`` itself.
    Called only on a failure: a transfer that succeeds pays nothing for it."""
    if isinstance(error, RanksLostError):
        return
    running_job = context.current_or_none()
    if running_job is None:
        return
    if core().survive_process_failures():
        # a transfer may see the failure before the communication thread has recorded it: give it a moment
        deadline = time.monotonic() + LOST_RANKS_GRACE_SECONDS
        while not running_job.engine.ranks_were_lost() and time.monotonic() < deadline:
            time.sleep(0.005)
    lost = running_job.ranks_lost(f"{_this_rank(running_job)} waited for {what}: {error}")
    if lost is not None:
        raise lost from error


def _wait_any(requests: Sequence[Any], abort: Sequence[Receive], peer: int, comm_f: int, what: str) -> int:
    """Waits until one of ``requests`` completes and returns its index.

    Raises the :class:`RemoteError` of an ``abort`` receive that completes first;
    :class:`PeerShutDownError` when rank ``peer`` of ``comm_f`` (the rank this wait is for) has shut
    down (after :data:`DEPARTURE_GRACE_SECONDS` for what it sent before); :class:`WaitTimeoutError` past
    ``timeout_seconds``. Warns on stderr past ``stall_check_seconds``.
    """
    config, policy = _wait_policy()
    running = context.current_or_none()
    departures = running.departures if running is not None else None
    started = time.monotonic()
    warned = False
    left_at: float | None = None
    watched = [*requests, *(receive._header_request for receive in abort)]
    while True:
        if running is not None and running.engine.ranks_were_lost():
            raise RuntimeError("the communication thread stopped: processes of the job failed")
        notice = departures.request if departures is not None else None
        now = time.monotonic()
        if departures is not None and departures.left and left_at is None:
            world = departures.world_rank(comm_f, peer)
            if world in departures.left:
                left_at = now
        deadlines = []
        if not warned:
            deadlines.append(started + config.stall_check_seconds)
        if config.timeout_seconds > 0:
            deadlines.append(started + config.timeout_seconds)
        if left_at is not None:
            deadlines.append(left_at + DEPARTURE_GRACE_SECONDS)
        timeout = max(0.0, min(deadlines) - now) if deadlines else -1.0
        index = core().wait_any(watched if notice is None else [*watched, notice], policy, timeout)
        if index < len(requests):
            return index
        if index < len(watched):
            abort[index - len(requests)]._open_header()  # raises RemoteError
        if index == len(watched) and notice is not None:
            departures.heard()  # type: ignore[union-attr]
            continue
        now = time.monotonic()
        name, _ = _peer(comm_f, peer, running)
        if left_at is not None and now >= left_at + DEPARTURE_GRACE_SECONDS:
            how = departures.how_left(departures.world_rank(comm_f, peer))  # type: ignore[union-attr, arg-type]
            fix = ("fix the error that rank reports" if how == FAILED else
                   "the ranks of a pipeline must make the same train_step / predict calls before hp.shutdown (are "
                   "the ranks fed different numbers of batches? shard the data by grid.replica over "
                   "grid.data_replicas, the same batches for every stage of a pipeline, as README shows)")
            error = PeerShutDownError(f"{name} {how} while {_this_rank(running)} waits for {what}: {fix}")
            error.source = peer
            raise error
        waited = now - started
        if config.timeout_seconds > 0 and waited >= config.timeout_seconds:
            error = WaitTimeoutError(
                f"{_this_rank(running)} waited {waited:.0f} s for {what} from {name} "
                f"(HYBRIDPIPE_TIMEOUT_SECONDS={config.timeout_seconds:g}): it is stopped, dead, or not making the "
                "same train_step / predict calls as this rank; if it is only slow (e.g. it alone saves a "
                "checkpoint or evaluates), raise HYBRIDPIPE_TIMEOUT_SECONDS (0: wait for ever)")
            error.source = peer
            raise error
        if not warned and waited >= config.stall_check_seconds:
            warned = True
            after = (f" This wait ends in an error at HYBRIDPIPE_TIMEOUT_SECONDS={config.timeout_seconds:g}."
                     if config.timeout_seconds > 0 else "")
            sys.stderr.write(
                f"hybridpipe WARNING: {_this_rank(running, host=True)} has waited {waited:.1f} s "
                f"for {what} from {name} (HYBRIDPIPE_STALL_CHECK_SECONDS={config.stall_check_seconds:g}): is it "
                f"slow, stopped, or making other calls than this rank (fewer train_step calls, a collective only "
                f"some ranks make)?{after}\n")
            sys.stderr.flush()


def _check_tag(tag: int) -> None:
    if not 0 <= tag < ERROR_TAG - 1:
        raise ValueError(f"p2p tag {tag} is outside 0..{ERROR_TAG - 2} (tags below ERROR_TAG={ERROR_TAG})")


class Send:
    """An in-flight send.

    Dropping it before it is done is safe: the C++ request holds the buffers until MPI is done with
    them (``hybridpipe._C.orphaned_transfers()`` counts such sends).
    """

    __slots__ = ("_requests", "dest", "_comm_f", "tag")

    def __init__(self, requests: list[Any], dest: int = 0, comm_f: int = 0, tag: int = 0) -> None:
        self._requests = requests
        self.dest, self._comm_f, self.tag = dest, comm_f, tag

    def test(self) -> bool:
        """True once every part was sent (the buffers may then be reused)."""
        return all(request.test() for request in self._requests)

    def wait(self, abort: Sequence[Receive] = (), what: str | None = None) -> None:
        """Blocks until every part was sent.

        Args:
            abort: error receives (see :func:`receive_error`); if one of them completes first, its
                :class:`RemoteError` is raised instead.
            what: what the receiver waits for, for messages (default: "the receive of tag T").

        Raises:
            PeerShutDownError: the receiver has shut down (hp.shutdown) before taking the message.
            WaitTimeoutError: the send waited past HYBRIDPIPE_TIMEOUT_SECONDS.
        """
        described = what or f"its receive of the message on tag {self.tag}"
        try:
            for request in self._requests:
                while not request.test():
                    _wait_any([request], abort, self.dest, self._comm_f, described)
        except RuntimeError as error:
            _raise_if_lost(error, described)
            raise


def _post_pickled(kind: int, value: Any, dest: int, tag: int, comm_f: int) -> Any:
    message = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    if len(message) > HEADER_CAPACITY:
        raise ValueError(f"the structure of the value to send pickles to {len(message)} bytes, more than "
                         f"HEADER_CAPACITY={HEADER_CAPACITY}: pass fewer tensors / smaller non-tensor "
                         "values between stages")
    return core().isend_copy(bytes((kind,)) + message, 0, 0, dest, tag, comm_f)


def _post_payload(tensor: torch.Tensor, dest: int, tag: int, comm_f: int, synchronized: set) -> Any:
    """Starts sending a tensor's data as a message of its own (in place when it is contiguous host memory)."""
    if devices.route(tensor) == "cuda-aware":  # device memory straight to MPI, once it is written
        host = tensor.detach().resolve_conj().resolve_neg().contiguous()
        if host.device not in synchronized:
            torch.cuda.current_stream(host.device).synchronize()
            synchronized.add(host.device)
    else:
        host = host_contiguous(tensor)
    return core().isend(host.data_ptr(), host.numel() * host.element_size(), dest, tag, comm_f, host)


@functools.lru_cache(maxsize=1024)
def _tensor_header(kind: int, dtype: torch.dtype, shape: torch.Size, requires_grad: bool) -> bytes | None:
    """A tensor's binary header (None: its dtype or number of dimensions has none). Cached: a pipeline's hops
    repeat a few shapes, and packing a shape costs more than finding it."""
    code = _DTYPE_CODES.get(dtype)
    if code is None or len(shape) > _MAX_DIMS:
        return None
    return _TENSOR.pack(kind, code, len(shape), requires_grad, *shape, *_NO_DIMS[len(shape):])


@functools.lru_cache(maxsize=1024)
def _header_leaf(header: bytes) -> _Leaf:
    """The :class:`_Leaf` a tensor's binary header describes (cached as :func:`_tensor_header`)."""
    _, code, dims, requires_grad, *shape = _TENSOR.unpack(header)
    return _Leaf(0, tuple(shape[:dims]), _DTYPES[code], requires_grad == 1)


def _send_tensor(tensor: torch.Tensor, dest: int, tag: int, comm_f: int) -> list[Any] | None:
    """Starts sending a plain tensor with its binary header (None: its dtype or rank has no header code)."""
    nbytes, on_host = tensor.nbytes, tensor.is_cpu
    inline = nbytes <= HEADER_CAPACITY and (on_host or devices.route(tensor) != "cuda-aware")
    header = _tensor_header(_TENSOR_INLINE if inline else _TENSOR_APART, tensor.dtype, tensor.shape,
                            tensor.requires_grad)
    if header is None:
        return None
    if not inline:
        return [core().isend_copy(header, 0, 0, dest, tag, comm_f),
                _post_payload(tensor, dest, tag + 1, comm_f, set())]
    plain = on_host and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
    host = tensor if plain else host_contiguous(tensor)
    return [core().isend_copy(header, host.data_ptr(), nbytes, dest, tag, comm_f)]


def _from_raw(data: bytes, leaf: _Leaf) -> torch.Tensor:
    if not data:
        return torch.empty(leaf.shape, dtype=leaf.dtype)
    flat = torch.frombuffer(bytearray(data), dtype=leaf.dtype)
    return flat if len(leaf.shape) == 1 else flat.view(leaf.shape)


def send(value: Any, dest: int, tag: int, comm: Any) -> Send:
    """Starts sending ``value`` to rank ``dest`` of ``comm`` on tags ``tag`` (first message), ``tag + 1``.

    A tensor of at most :data:`HEADER_CAPACITY` bytes is copied into its message; larger contiguous CPU
    tensors are sent in place: do not modify them in place until the returned :class:`Send` is done
    (:meth:`Send.test` / :meth:`Send.wait`), or the receiver may get the new values. Wait for the
    :class:`Send` before the job ends.
    """
    _check_tag(tag)
    try:
        return _send(value, dest, tag, comm.py2f())
    except RuntimeError as error:
        _raise_if_lost(error, f"the post of a send to rank {dest}")
        raise


def _send(value: Any, dest: int, tag: int, comm_f: int) -> Send:
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:  # the usual hop: no tree walk, no pickling
        requests = _send_tensor(value, dest, tag, comm_f)
        if requests is not None:
            return Send(requests, dest, comm_f, tag)
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(value, tensors)
    if sum(t.numel() * t.element_size() for t in tensors) <= INLINE_BYTES:
        payload = [raw_bytes(tensor) for tensor in tensors]
        message = pickle.dumps((skeleton, payload), protocol=pickle.HIGHEST_PROTOCOL)
        if len(message) <= HEADER_CAPACITY:
            request = core().isend_copy(bytes((_PICKLED,)) + message, 0, 0, dest, tag, comm_f)
            return Send([request], dest, comm_f, tag)
    requests = [_post_pickled(_PICKLED, (skeleton, None), dest, tag, comm_f)]
    synchronized: set = set()
    requests += [_post_payload(tensor, dest, tag + 1, comm_f, synchronized) for tensor in tensors]
    return Send(requests, dest, comm_f, tag)


def send_error(text: str, rank: int, dest: int, comm: Any) -> Send:
    """Tells rank ``dest`` that rank ``rank`` failed with ``text`` (a small, eager message)."""
    request = _post_pickled(_ERROR, (rank, text[-4000:]), dest, ERROR_TAG, comm.py2f())
    return Send([request], dest, comm.py2f(), ERROR_TAG)


def forget(comm: Any) -> None:
    """Drops the receives on ``comm`` whose headers were never opened (a pipeline that failed or was closed in the
    middle of a step), before ``comm`` is freed: MPI may give a later communicator the same handle, whose
    receives must not find these as "earlier" ones on their source and tag (whose requests a stopped
    communication thread has failed)."""
    handle, unopened = comm.py2f(), running.unopened_receives()
    for key in [key for key in unopened if key[0] == handle]:
        del unopened[key]


class Receive:
    """A receive posted now (header first); :meth:`wait` returns the value.

    Several receives from one source on one tag get that source's messages in send order, and may
    be polled and waited in any order.

    Args:
        source: rank in ``comm`` to receive from.
        tag: the sender's tag (the payloads come on ``tag + 1``).
        comm: an mpi4py communicator.
        device: where the received tensors end up (default: CPU).
        requires_grad: restore ``requires_grad`` of floating-point tensors as the sender had it.
        what: what this is, for messages about the wait (e.g. "its activation of micro-batch 3";
            default "the message on tag T").
    """

    __slots__ = ("what", "source", "tag", "_comm_f", "_device", "_requires_grad", "_header_request", "_header",
                 "_skeleton", "_tensors", "_payload_requests", "_value", "_done", "_key", "_unopened", "__weakref__")

    def __init__(self, source: int, tag: int, comm: Any, device: Any = None, requires_grad: bool = False,
                 _error_tag: bool = False, what: str | None = None) -> None:
        self.what = what
        if not _error_tag:
            _check_tag(tag)
        self.source, self.tag, self._comm_f = source, tag, comm.py2f()
        # where wait() moves the tensors to (None: they stay where they landed, on the host)
        kind = None if device is None else device.type if type(device) is torch.device else torch.device(device).type
        self._device = None if kind in (None, "cpu") else device
        self._requires_grad = requires_grad
        try:
            self._header_request, self._header = core().irecv_message(MESSAGE_CAPACITY, source, tag, self._comm_f)
        except RuntimeError as error:
            _raise_if_lost(error, f"the post of a receive from rank {source}")
            raise
        self._skeleton: Any = None
        self._tensors: list[torch.Tensor] = []
        self._payload_requests: list[Any] = []
        self._value: Any = None
        self._done = False
        # Receives posted on one (communicator, source, tag) whose header is not opened yet, in posting order (the
        # job's, see running.unopened_receives). MPI matches their headers to messages in that order, so their
        # payload receives (all on tag + 1) must be posted in that order too, whichever is polled or waited first.
        self._unopened = running.unopened_receives()
        if _error_tag:
            self._key = None
            return
        self._key = (self._comm_f, source, tag)
        self._unopened.setdefault(self._key, []).append(weakref.ref(self))

    def _open_header(self, block: bool = True) -> bool:
        """Our header is in: open it, after the headers of the earlier receives on our source and tag
        (MPI matched those to earlier messages) so that payload receives are posted in message order.

        Returns False, without blocking, when ``block`` is False and an earlier header is not in yet.
        """
        queue = self._unopened.get(self._key, ()) if self._key is not None else ()
        if queue and queue[0]() is self:  # the usual case, the earliest one, found without a search
            position: int | None = 0
        else:
            position = next((i for i, ref in enumerate(queue) if ref() is self), None)
        earlier: list[Receive] = []
        if position is not None:
            if position:
                earlier = [receive for ref in queue[:position]
                           if (receive := ref()) is not None and receive._skeleton is None and not receive._done]
                if not block and not all(receive._header_request.test() for receive in earlier):
                    return False
            del queue[:position + 1]
            if not queue:
                del self._unopened[self._key]
            for receive in earlier:
                receive._header_request.wait(_wait_policy()[1])  # matched before ours: in, or just arriving
                receive._decode_header()
        self._decode_header()
        return True

    def _decode_header(self) -> None:
        """The first message is in: decode it and post the payload receives."""
        size = self._header_request.received_bytes
        buffer = self._header
        kind = buffer[0]
        if kind == _TENSOR_INLINE or kind == _TENSOR_APART:
            self._skeleton = leaf = _header_leaf(bytes(buffer[:_TENSOR.size]))
            if kind == _TENSOR_APART:
                self._post_payloads([leaf])
            elif size > _TENSOR.size:
                del buffer[size:]  # the tensor keeps only the message's memory
                flat = torch.frombuffer(buffer, dtype=leaf.dtype, offset=_TENSOR.size)
                self._tensors = [flat if len(leaf.shape) == 1 else flat.view(leaf.shape)]
            else:
                self._tensors = [torch.empty(leaf.shape, dtype=leaf.dtype)]
            return
        value = pickle.loads(memoryview(buffer)[1:size])
        if kind == _ERROR:
            raise RemoteError(value[1], source=self.source)
        self._skeleton, payload = value
        if payload is not None:
            self._tensors = [_from_raw(data, leaf) for data, leaf in zip(payload, _leaves(self._skeleton))]
        else:
            self._post_payloads(_leaves(self._skeleton))

    def _post_payloads(self, leaves: list[_Leaf]) -> None:
        # a CUDA-aware MPI receives into device memory; otherwise into host memory, copied over in wait()
        land = self._device if self._device is not None and torch.device(self._device).type == "cuda" \
            and devices.cuda_aware() else "cpu"
        for leaf in leaves:
            tensor = torch.empty(leaf.shape, dtype=leaf.dtype, device=land)
            self._tensors.append(tensor)
            nbytes = tensor.numel() * tensor.element_size()
            self._payload_requests.append(
                core().irecv(tensor.data_ptr(), nbytes, self.source, self.tag + 1, self._comm_f, tensor))

    @property
    def opened(self) -> bool:
        """Whether the header is in (payload receives posted) or the value is complete."""
        return self._done or self._skeleton is not None

    def poll(self) -> bool:
        """Makes progress without blocking (posts payload receives once the header is in)."""
        if self._done:
            return True
        if self._skeleton is None:
            if not self._header_request.test() or not self._open_header(block=False):
                return False
        return all(request.test() for request in self._payload_requests)

    def wait(self, abort: Sequence[Receive] = (), what: str | None = None) -> Any:
        """Blocks until the value is in and returns it.

        Args:
            abort: error receives (see :func:`receive_error`); if one of them completes first, its
                :class:`RemoteError` is raised instead.
            what: what this rank waits for, for messages (default: the ``what`` given at construction).

        Raises:
            RemoteError: an ``abort`` receive got the sender's error.
            PeerShutDownError: the sender has shut down (hp.shutdown) without sending it.
            WaitTimeoutError: the wait lasted past HYBRIDPIPE_TIMEOUT_SECONDS.
        """
        if self._done:
            return self._value
        try:
            return self._wait(abort, what)
        except RuntimeError as error:
            _raise_if_lost(error, self._described(what))
            raise

    def _wait(self, abort: Sequence[Receive], what: str | None) -> Any:
        if self._skeleton is None:
            request = self._header_request
            if not request.wait_for(FAST_WAIT_SECONDS, _wait_policy()[1]):  # the hop's wait: no Python
                _wait_any([request], abort, self.source, self._comm_f, self._described(what))
            self._open_header()
        for request in self._payload_requests:
            while not request.test():
                _wait_any([request], abort, self.source, self._comm_f, self._described(what))
        tensors = self._tensors
        if self._device is not None:
            tensors = [tensor.to(self._device) for tensor in tensors]
        skeleton = self._skeleton
        plain = type(skeleton) is _Leaf  # a plain tensor: no structure to walk
        if self._requires_grad:
            for leaf, tensor in zip([skeleton] if plain else _leaves(skeleton), tensors):
                if leaf.requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
                    tensor.requires_grad_(True)
        value = tensors[0] if plain else _rebuild(skeleton, tensors)
        self._value = value
        self._done = True
        self._header = self._tensors = self._payload_requests = None  # type: ignore[assignment]
        return value

    def _described(self, what: str | None) -> str:
        return what or self.what or f"the message on tag {self.tag}"

    def cancel(self) -> None:
        """Withdraws a receive whose header has not arrived (e.g. at shutdown)."""
        if not self._done and self._skeleton is None:
            self._header_request.cancel()
            self._done = True
            queue = self._unopened.get(self._key) if self._key is not None else None
            if queue is not None:
                queue[:] = [ref for ref in queue if ref() is not self]
                if not queue:
                    del self._unopened[self._key]


def receive_error(source: int, comm: Any) -> Receive:
    """Posts a receive for an error message from ``source``; pass it as ``abort=`` to waits."""
    return Receive(source, ERROR_TAG, comm, _error_tag=True)
