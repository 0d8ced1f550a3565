"""Point-to-point transport of structured values (a tensor, or tuples/lists/dicts of tensors).

This is how the pipeline moves activations forward and gradients backward. A message is:

* a **header**: the value's structure with every tensor replaced by its shape, dtype and
  ``requires_grad`` (pickled; non-tensor leaves such as ``None`` or ints travel inside it), sent
  on tag ``tag``. The receiver posts the header receive early into a fixed buffer of
  :data:`HEADER_CAPACITY` bytes, so it never needs to know shapes in advance and shapes may change
  from one step to the next;
* then one **payload** message per tensor, raw bytes, on tag ``tag + 1``. The receiver allocates
  the tensors as soon as the header is in and posts their receives.

So a sender and receiver each consume two consecutive tags per message; callers use even tags.
Both directions go through the C++ core (``hybridpipe._C.isend/irecv``), which releases the GIL
while waiting. After ``hp.init`` the engine's communication thread makes their MPI calls (the one
thread that makes all of hybridpipe's MPI calls, see docs/concepts.md); the calling thread queues a
transfer and waits for it. Each request holds its buffers until MPI is done with them, so dropping
a :class:`Send` or :class:`Receive` in flight is safe. Tensors on a GPU are staged through host
memory for now.

A stage that fails sends an **error message** on :data:`ERROR_TAG` to its neighbours; a receive
waiting with ``abort=`` on such an error raises :class:`RemoteError` instead of hanging.
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ..config import Config
from ..errors import HybridPipeError
from .._ext import core
from . import context
from . import device as devices
from .buffers import host_contiguous, raw_bytes

__all__ = ["HEADER_CAPACITY", "ERROR_TAG", "RemoteError", "Send", "Receive", "send", "send_error",
           "receive_error"]

#: Largest pickled structure a header may hold (bytes).
HEADER_CAPACITY = 64 * 1024
#: Tag of error messages (the payload tag, ERROR_TAG + 1, is never used).
ERROR_TAG = 32000
_ERROR_MARK = "__hybridpipe_remote_error__"
_INLINE_MARK = "__hybridpipe_inline__"
#: Values whose tensors hold at most this many bytes in all travel inside the header message: one
#: MPI message per value instead of 1 + tensors (small activations are latency-bound).
INLINE_BYTES = 32 * 1024


class RemoteError(HybridPipeError):
    """A peer failed and told us so; the message names the failing rank and its error.

    Attributes:
        source: the rank (in the communicator) the error message came from.
    """


@dataclass(frozen=True)
class _Leaf:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _skeleton(value: Any, leaves: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its :class:`_Leaf` (appended to ``leaves``)."""

    def describe(tensor: torch.Tensor) -> _Leaf:
        leaves.append(tensor)
        return _Leaf(len(leaves) - 1, tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    return pytree.tree_map_only(torch.Tensor, describe, value)


def _rebuild(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    return pytree.tree_map_only(_Leaf, lambda leaf: tensors[leaf.index], skeleton)


def _leaves(skeleton: Any) -> list[_Leaf]:
    return sorted((leaf for leaf in pytree.tree_leaves(skeleton) if isinstance(leaf, _Leaf)),
                  key=lambda leaf: leaf.index)


_policy: tuple[Config, Any] | None = None


def _wait_policy() -> Any:
    """How waits here block without hp.init (with it, the communication thread makes the MPI calls and
    the caller sleeps until it is done): the configured polite wait (spin briefly, then sleep between
    tests), so that a stage waiting for its neighbour leaves the core to compute (HYBRIDPIPE_WAIT_SPIN_US)."""
    global _policy
    running = context.current_or_none()
    config = running.config if running is not None else Config.from_env()
    if _policy is None or _policy[0] is not config:
        _policy = (config, context.wait_policy(config))
    return _policy[1]


def _check_tag(tag: int) -> None:
    if not 0 <= tag < ERROR_TAG - 1:
        raise ValueError(f"p2p tag {tag} is outside 0..{ERROR_TAG - 2} (tags below ERROR_TAG={ERROR_TAG})")


class Send:
    """An in-flight send.

    Dropping it before it is done is safe: the C++ request holds the buffers until MPI is done with
    them (``hybridpipe._C.orphaned_transfers()`` counts such sends).
    """

    def __init__(self, requests: list[Any]) -> None:
        self._requests = requests

    def test(self) -> bool:
        """True once every part was sent (the buffers may then be reused)."""
        return all(request.test() for request in self._requests)

    def wait(self, abort: Sequence[Receive] = ()) -> None:
        """Blocks until every part was sent.

        Args:
            abort: error receives (see :func:`receive_error`); if one of them completes first, its
                :class:`RemoteError` is raised instead.
        """
        policy = _wait_policy()
        for request in self._requests:
            if not abort:
                request.wait(policy)
                continue
            while not request.test():
                index = core().wait_any([request, *(r._header_request for r in abort)], policy)
                if index > 0:
                    abort[index - 1]._open_header()  # raises RemoteError


def _post_header(header: bytes, dest: int, tag: int, comm_f: int) -> Any:
    if len(header) > HEADER_CAPACITY:
        raise ValueError(f"the structure of the value to send pickles to {len(header)} bytes, more than "
                         f"HEADER_CAPACITY={HEADER_CAPACITY}: pass fewer tensors / smaller non-tensor "
                         "values between stages")
    buffer = np.frombuffer(header, dtype=np.uint8)
    return core().isend(buffer.ctypes.data, buffer.nbytes, dest, tag, comm_f, buffer)


def _from_raw(data: bytes, leaf: _Leaf) -> torch.Tensor:
    if not data:
        return torch.empty(leaf.shape, dtype=leaf.dtype)
    return torch.frombuffer(bytearray(data), dtype=leaf.dtype).reshape(leaf.shape)


def send(value: Any, dest: int, tag: int, comm: Any) -> Send:
    """Starts sending ``value`` to rank ``dest`` of ``comm`` on tags ``tag`` (header), ``tag + 1``.

    Contiguous CPU tensors are sent in place, not copied: do not modify them in place until the
    returned :class:`Send` is done (:meth:`Send.test` / :meth:`Send.wait`), or the receiver may
    get the new values. (Non-contiguous and GPU tensors are copied first, but do not rely on it.)
    Wait for the :class:`Send` before the job ends.
    """
    _check_tag(tag)
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(value, tensors)
    comm_f = comm.py2f()
    if sum(t.numel() * t.element_size() for t in tensors) <= INLINE_BYTES:
        payload = [raw_bytes(tensor) for tensor in tensors]
        message = pickle.dumps((_INLINE_MARK, skeleton, payload), protocol=pickle.HIGHEST_PROTOCOL)
        if len(message) <= HEADER_CAPACITY:
            return Send([_post_header(message, dest, tag, comm_f)])
    requests = [_post_header(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), dest, tag, comm_f)]
    synchronized: set = set()
    for tensor in tensors:
        if devices.route(tensor) == "cuda-aware":  # device memory straight to MPI, once it is written
            host = tensor.detach().resolve_conj().resolve_neg().contiguous()
            if host.device not in synchronized:
                torch.cuda.current_stream(host.device).synchronize()
                synchronized.add(host.device)
        else:
            host = host_contiguous(tensor)
        nbytes = host.numel() * host.element_size()
        requests.append(core().isend(host.data_ptr(), nbytes, dest, tag + 1, comm_f, host))
    return Send(requests)


def send_error(text: str, rank: int, dest: int, comm: Any) -> Send:
    """Tells rank ``dest`` that rank ``rank`` failed with ``text`` (a small, eager message)."""
    header = pickle.dumps((_ERROR_MARK, rank, text[-4000:]), protocol=pickle.HIGHEST_PROTOCOL)
    return Send([_post_header(header, dest, ERROR_TAG, comm.py2f())])


# Receives posted on one (communicator, source, tag) whose header is not opened yet, in posting
# order. MPI matches their headers to messages in that order, so their payload receives (all on
# tag + 1) must be posted in that order too, whichever receive is polled or waited first.
_unopened: dict[tuple[int, int, int], list[weakref.ref]] = {}


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
    """

    def __init__(self, source: int, tag: int, comm: Any, device: Any = None, requires_grad: bool = False,
                 _error_tag: bool = False) -> None:
        if not _error_tag:
            _check_tag(tag)
        self.source, self.tag, self._comm_f = source, tag, comm.py2f()
        self._device, self._requires_grad = device, requires_grad
        self._header = np.empty(HEADER_CAPACITY, dtype=np.uint8)
        self._header_request = core().irecv(self._header.ctypes.data, HEADER_CAPACITY, source, tag, self._comm_f,
                                            self._header)
        self._skeleton: Any = None
        self._tensors: list[torch.Tensor] = []
        self._payload_requests: list[Any] = []
        self._value: Any = None
        self._done = False
        self._key = None if _error_tag else (self._comm_f, source, tag)
        if self._key is not None:
            _unopened.setdefault(self._key, []).append(weakref.ref(self))

    def _open_header(self, block: bool = True) -> bool:
        """Our header is in: open it, after the headers of the earlier receives on our source and tag
        (MPI matched those to earlier messages) so that payload receives are posted in message order.

        Returns False, without blocking, when ``block`` is False and an earlier header is not in yet.
        """
        queue = _unopened.get(self._key, []) if self._key is not None else []
        position = next((i for i, ref in enumerate(queue) if ref() is self), None)
        if position is not None:
            earlier = [receive for ref in queue[:position]
                       if (receive := ref()) is not None and receive._skeleton is None and not receive._done]
            if not block and not all(receive._header_request.test() for receive in earlier):
                return False
            del queue[:position + 1]
            if not queue:
                del _unopened[self._key]
            for receive in earlier:
                receive._header_request.wait(_wait_policy())  # matched before ours: in, or just arriving
                receive._decode_header()
        self._decode_header()
        return True

    def _decode_header(self) -> None:
        """The header is in: decode it and post the payload receives."""
        size = self._header_request.received_bytes
        skeleton = pickle.loads(self._header[:size].tobytes())
        if isinstance(skeleton, tuple) and len(skeleton) == 3 and skeleton[0] == _ERROR_MARK:
            error = RemoteError(skeleton[2])
            error.source = self.source  # type: ignore[attr-defined]
            raise error
        if isinstance(skeleton, tuple) and len(skeleton) == 3 and skeleton[0] == _INLINE_MARK:
            self._skeleton = skeleton[1]
            self._tensors = [_from_raw(data, leaf) for data, leaf in zip(skeleton[2], _leaves(skeleton[1]))]
            return
        self._skeleton = skeleton
        # a CUDA-aware MPI receives into device memory; otherwise into host memory, copied over in wait()
        land = self._device if self._device is not None and torch.device(self._device).type == "cuda" \
            and devices.cuda_aware() else "cpu"
        for leaf in _leaves(skeleton):
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

    def wait(self, abort: Sequence[Receive] = ()) -> Any:
        """Blocks until the value is in and returns it.

        Args:
            abort: error receives (see :func:`receive_error`); if one of them completes first, its
                :class:`RemoteError` is raised instead.
        """
        if self._done:
            return self._value
        policy = _wait_policy()
        if self._skeleton is None:
            if abort:
                requests = [self._header_request, *(r._header_request for r in abort)]
                index = core().wait_any(requests, policy)
                if index > 0:
                    abort[index - 1]._open_header()  # raises RemoteError
            else:
                self._header_request.wait(policy)
            self._open_header()
        for request in self._payload_requests:
            request.wait(policy)
        tensors = self._tensors
        if self._device is not None and torch.device(self._device).type != "cpu":
            tensors = [tensor.to(self._device) for tensor in tensors]
        if self._requires_grad:
            for leaf, tensor in zip(_leaves(self._skeleton), tensors):
                if leaf.requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
                    tensor.requires_grad_(True)
        self._value = _rebuild(self._skeleton, tensors)
        self._done = True
        self._header = self._tensors = self._payload_requests = None  # type: ignore[assignment]
        return self._value

    def cancel(self) -> None:
        """Withdraws a receive whose header has not arrived (e.g. at shutdown)."""
        if not self._done and self._skeleton is None:
            self._header_request.cancel()
            self._done = True
            queue = _unopened.get(self._key) if self._key is not None else None
            if queue is not None:
                queue[:] = [ref for ref in queue if ref() is not self]
                if not queue:
                    del _unopened[self._key]


def receive_error(source: int, comm: Any) -> Receive:
    """Posts a receive for an error message from ``source``; pass it as ``abort=`` to waits."""
    return Receive(source, ERROR_TAG, comm, _error_tag=True)
