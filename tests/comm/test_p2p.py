"""The structured point-to-point transport (hybridpipe/comm/p2p.py) under real MPI, at 2 and 3 ranks.

Ring tests: every rank sends to ``rank + 1`` and receives from ``rank - 1`` (mod size), so every
rank sends and receives at once. Pair tests: rank 1 sends to rank 0, other ranks only join the
barriers that order the two. Each test uses tags of its own so that a failing test cannot leave
messages behind for the next one. The receiver rebuilds the sender's values from a seed and
compares exactly.
"""

import gc
import sys
import time
from collections import namedtuple

import pytest
import torch
from mpi4py import MPI

import hybridpipe as hp
from agree import ranks_agree
from hybridpipe import _ext
from hybridpipe.comm import p2p

pytestmark = pytest.mark.mpi(ranks=[2], long_ranks=[3], timeout=300, shared=True)

Pair = namedtuple("Pair", "left right")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
# empty, empty with more dims, 0-dim, one element, odd 2-D, 4-D, 7-D (the most a binary header holds), 8-D (pickled)
SHAPES = [(0,), (3, 0, 2), (), (1,), (7, 13), (2, 3, 4, 5), (1, 2, 1, 3, 1, 2, 2), (2, 1, 2, 1, 1, 2, 1, 3)]


@pytest.fixture(scope="module", params=["engine", "caller"])
def comm(request):
    """Every test runs twice: after hp.init, where the engine's communication thread makes the
    transfers' MPI calls, and without it, where the calling thread makes them."""
    if request.param == "engine":
        hp.init()
    assert _ext.core().transfers_driven() == (request.param == "engine")
    world = MPI.COMM_WORLD.Dup()
    yield world
    world.Barrier()
    world.Free()
    if request.param == "engine":
        hp.shutdown()
        assert not _ext.core().transfers_driven()


def ring(comm):
    return (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size


def make(dtype, shape, seed):
    """A deterministic tensor of exactly representable values (any rank can rebuild it)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        drawn = dtype if dtype in (torch.float64, torch.complex64) else torch.float32
        return (torch.randn(shape, generator=generator, dtype=drawn) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -2**62), min(info.max, 2**62), shape, generator=generator,
                         dtype=torch.int64).to(dtype)


def assert_same(got, want):
    assert isinstance(got, torch.Tensor), f"got {type(got).__name__}, want a tensor"
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    assert torch.equal(got, want), f"values differ: got {got}, want {want}"


def exchange(comm, value, tag, **receive_options):
    """Ring: sends ``value`` on, returns what the previous rank sent."""
    source, dest = ring(comm)
    receive = p2p.Receive(source, tag, comm, **receive_options)
    send = p2p.send(value, dest, tag, comm)
    got = receive.wait()
    send.wait()
    return got


# ------------------------------------------------------------------ tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_round_trip_every_dtype_and_shape(comm, dtype):
    source, _ = ring(comm)
    for case, shape in enumerate(SHAPES):
        got = exchange(comm, make(dtype, shape, seed=100 * case + comm.rank), tag=10)
        want = make(dtype, shape, seed=100 * case + source)
        with ranks_agree(comm, what=f"shape {shape}"):  # a rank leaving early would strand the next exchange
            assert_same(got, want)
            assert got.is_contiguous() and not got.requires_grad


def test_small_values_travel_in_one_message_large_ones_with_payloads(comm):
    source, dest = ring(comm)
    small = (torch.arange(6, dtype=torch.bfloat16), torch.tensor(True), torch.empty(0, 3), {"n": 7})
    large = [torch.arange(p2p.INLINE_BYTES // 4 + 1, dtype=torch.float32)]  # a structure one element past the limit
    # a plain tensor goes with its binary header up to HEADER_CAPACITY bytes of data
    tensor = torch.arange(p2p.HEADER_CAPACITY // 4, dtype=torch.float32)
    big = torch.arange(p2p.HEADER_CAPACITY // 4 + 1, dtype=torch.float32)
    values = [small, large, tensor, big]
    receives = [p2p.Receive(source, 24, comm) for _ in values]
    sends = [p2p.send(value, dest, 24, comm) for value in values]
    assert [len(send._requests) for send in sends] == [1, 2, 1, 2]
    got_small, got_large, got_tensor, got_big = [receive.wait() for receive in receives]
    for got, want in zip(got_small[:3], small[:3]):
        assert_same(got, want)
    assert got_small[3] == {"n": 7}
    assert isinstance(got_large, list) and len(got_large) == 1
    assert_same(got_large[0], large[0])
    assert_same(got_tensor, tensor)
    assert_same(got_big, big)
    for send in sends:
        send.wait()


def test_large_tensor(comm):
    source, _ = ring(comm)
    count = 3_000_000
    got = exchange(comm, make(torch.float32, (count,), seed=comm.rank), tag=20)
    assert_same(got, make(torch.float32, (count,), seed=source))
    got = exchange(comm, make(torch.float64, (1000, 1500), seed=comm.rank).t(), tag=20)  # 12 MB, transposed
    assert_same(got, make(torch.float64, (1000, 1500), seed=source).t().contiguous())


def test_non_contiguous_and_view_inputs(comm):
    source, _ = ring(comm)

    def views(seed):
        base = make(torch.float32, (6, 8), seed)
        complex_base = make(torch.complex64, (5,), seed)
        return (base.t(), base[:, ::3], base[2:4], base[1], base[0, 0], base[:1].expand(4, 8),
                base.view(2, 3, 8).permute(2, 0, 1), complex_base.conj(), complex_base.conj().imag)

    got = exchange(comm, views(comm.rank), tag=30)
    want = views(source)
    assert len(got) == len(want)
    for got_tensor, want_tensor in zip(got, want):
        assert_same(got_tensor, want_tensor.resolve_conj().resolve_neg().contiguous())
    # the conjugated view really arrives conjugated (its raw memory holds the unconjugated values)
    assert torch.equal(got[7].imag, -make(torch.complex64, (5,), source).imag)


def test_tensor_in_a_graph_is_sent_detached(comm):
    source, _ = ring(comm)
    x = make(torch.float32, (4,), comm.rank).requires_grad_(True)
    got = exchange(comm, torch.tanh(x) * 2, tag=40)
    assert_same(got, torch.tanh(make(torch.float32, (4,), source)) * 2)
    assert got.grad_fn is None and not got.requires_grad
    assert x.grad is None  # the send touched nothing in the sender's graph


# ------------------------------------------------------------------ structures


def structure(seed):
    t = lambda i, shape=(3,), dtype=torch.float32: make(dtype, shape, 1000 * seed + i)  # noqa: E731
    shared = t(9, (2, 2))
    return {
        "tuple": (t(0), t(1, (), torch.int64)),
        "list": [t(2, (0,)), None, 7, "text", 2.5, True],
        "nested": {"inner": (t(3), {"deep": [t(4, (2,), torch.bool)]}), "empty": ((), [], {})},
        "pair": Pair(t(5), Pair(None, t(6, (1,), torch.bfloat16))),
        "twice": (shared, shared),
        "bytes": b"\x00\xff",
        3: "non-string key",
    }


def assert_same_structure(got, want):
    assert type(got) is type(want), f"got {type(got).__name__}, want {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert_same(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)  # same keys, same order
        for key in want:
            assert_same_structure(got[key], want[key])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for got_item, want_item in zip(got, want):
            assert_same_structure(got_item, want_item)
    else:
        assert got == want


def test_structures_arrive_with_their_types_and_leaves(comm):
    source, _ = ring(comm)
    got = exchange(comm, structure(comm.rank), tag=50)
    assert_same_structure(got, structure(source))
    assert got["pair"].right.left is None and got["pair"]._fields == ("left", "right")
    # the same tensor twice arrives as two equal tensors that do not share memory
    first, second = got["twice"]
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    first.add_(1)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("value", [None, 42, "just a string", (), [], {}, (None, 1, "a")], ids=repr)
def test_values_without_tensors(comm, value):
    got = exchange(comm, value, tag=60)
    assert type(got) is type(value) and got == value


# ------------------------------------------------------------------ requires_grad


def grad_case(seed):
    leaf = make(torch.float32, (3,), seed).requires_grad_(True)
    return {
        "leaf": leaf,
        "non_leaf": leaf * 2,
        "half": make(torch.float16, (2,), seed + 1).requires_grad_(True),
        "bfloat16": make(torch.bfloat16, (2,), seed + 2).requires_grad_(True),
        "float64": make(torch.float64, (), seed + 3).requires_grad_(True),
        "plain": make(torch.float32, (3,), seed + 4),
        "int": make(torch.int64, (3,), seed + 5),
        "bool": make(torch.bool, (3,), seed + 6),
    }


def test_requires_grad_restored_only_when_asked_and_only_for_floats(comm):
    source, _ = ring(comm)
    want = {key: value.detach() for key, value in grad_case(source).items()}
    requiring = {"leaf", "non_leaf", "half", "bfloat16", "float64"}

    got = exchange(comm, grad_case(comm.rank), tag=70, requires_grad=True)
    for key, value in want.items():
        assert_same(got[key].detach(), value)
        assert got[key].requires_grad == (key in requiring), key
        assert got[key].is_leaf and got[key].grad_fn is None, key
    (got["leaf"] * 3 + got["non_leaf"]).sum().backward()  # the receiver can start a graph from them
    assert torch.equal(got["leaf"].grad, torch.full((3,), 3.0))
    assert torch.equal(got["non_leaf"].grad, torch.ones(3))

    got = exchange(comm, grad_case(comm.rank), tag=70, requires_grad=False)
    for key, value in want.items():
        assert_same(got[key], value)
        assert not got[key].requires_grad, key


# ------------------------------------------------------------------ shapes, ordering, poll


def activation(step, length, seed):
    """A pipeline-like message whose shapes depend on the sequence length."""
    return (make(torch.float32, (2, length, 4), 10 * seed + step), make(torch.bool, (2, length), 10 * seed + step),
            length)


def test_shapes_change_between_messages_on_the_same_tags(comm):
    source, dest = ring(comm)
    lengths = [5, 9, 1, 0, 9, 3]
    for step, length in enumerate(lengths):  # one message in flight at a time
        forward = exchange(comm, activation(step, length, comm.rank), tag=80)
        with ranks_agree(comm, what=f"step {step} forward"):
            assert_same_structure(forward, activation(step, length, source))
        backward = exchange(comm, forward[0] * 2, tag=82)
        with ranks_agree(comm, what=f"step {step} backward"):
            assert_same(backward, activation(step, length, (source - 1) % comm.size)[0] * 2)
    # all receives posted first, then every message of the sequence is sent at once
    receives = [p2p.Receive(source, 84, comm) for _ in lengths]
    sends = [p2p.send(activation(step, length, comm.rank), dest, 84, comm) for step, length in enumerate(lengths)]
    for step, (receive, length) in enumerate(zip(receives, lengths)):
        assert_same_structure(receive.wait(), activation(step, length, source))
    for send in sends:
        send.wait()


def numbered(i):
    """Message i of a sequence: sizes differ; some travel inline in the header message (at most
    p2p.INLINE_BYTES of tensor data), others with payload messages past the eager limit."""
    size = [3, 100_000, 0, 17, 1, 40_000][i % 6]
    return i, torch.full((size,), float(i)), f"message {i}"


def check_numbered(got, i):
    index, tensor, text = got
    assert (index, text) == (i, f"message {i}"), f"message {index} arrived as number {i}"
    assert_same(tensor, numbered(i)[1])


def test_same_tag_messages_arrive_in_send_order(comm):
    count = 6
    # 1. receives posted before the sends
    if comm.rank == 0:
        receives = [p2p.Receive(1, 90, comm) for _ in range(count)]
        comm.Barrier()
        for i, receive in enumerate(receives):
            check_numbered(receive.wait(), i)
    elif comm.rank == 1:
        comm.Barrier()
        sends = [p2p.send(numbered(i), 0, 90, comm) for i in range(count)]
        for send in sends:
            send.wait()
    else:
        comm.Barrier()
    comm.Barrier()
    # 2. receives posted after the sends
    if comm.rank == 1:
        sends = [p2p.send(numbered(i), 0, 92, comm) for i in range(count)]
        comm.Barrier()
        for send in sends:
            send.wait()
    else:
        comm.Barrier()
        if comm.rank == 0:
            receives = [p2p.Receive(1, 92, comm) for _ in range(count)]
            for i, receive in enumerate(receives):
                check_numbered(receive.wait(), i)
    comm.Barrier()


def test_same_tag_receives_waited_or_polled_out_of_order(comm):
    """Receives match messages in posting order even when a later one is waited or polled first
    (before the fix the later receive's payload receives matched the earlier message's payloads:
    wrong values or MPI_ERR_TRUNCATE, and sends that never complete)."""
    count = 6
    if comm.rank == 1:
        comm.Barrier()
        sends = [p2p.send(numbered(i), 0, tag, comm) for tag in (94, 96) for i in range(count)]
        comm.Barrier()
        if p2p.Receive(0, 98, comm).wait():  # rank 0 checked everything: the sends can complete
            for send in sends:
                send.wait()
    elif comm.rank == 0:
        waited = [p2p.Receive(1, 94, comm) for _ in range(count)]
        polled = [p2p.Receive(1, 96, comm) for _ in range(count)]
        comm.Barrier()
        comm.Barrier()  # every message has been sent
        checked = False
        try:
            for i in reversed(range(count)):
                check_numbered(waited[i].wait(), i)
            deadline = time.monotonic() + 30
            while not all([receive.poll() for receive in reversed(polled)]):
                assert time.monotonic() < deadline, "poll() never saw every message"
                time.sleep(1e-4)
            for i in (3, 0, 5, 1, 4, 2):
                check_numbered(polled[i].wait(), i)
            checked = True
        finally:  # on failure rank 1 must not wait for sends that may never complete
            p2p.send(checked, 1, 98, comm).wait()
    else:
        comm.Barrier()
        comm.Barrier()
    comm.Barrier()


def test_poll_false_before_send_true_after(comm):
    if comm.rank == 0:
        receive = p2p.Receive(1, 100, comm)
        early = [receive.poll(), receive.poll()]
        comm.Barrier()  # A: rank 1 sends only after this
        comm.Barrier()  # B: rank 1 has sent
    elif comm.rank == 1:
        comm.Barrier()
        send = p2p.send(structure(1), 0, 100, comm)
        comm.Barrier()
        send.wait()
    else:
        comm.Barrier()
        comm.Barrier()
    with ranks_agree(comm):  # (the others wait there for rank 0's checks)
        if comm.rank == 0:
            assert early == [False, False]
            deadline = time.monotonic() + 30
            while not receive.poll():
                assert time.monotonic() < deadline, "poll() stayed False after the send"
                time.sleep(1e-4)
            assert receive.poll() is True
            assert_same_structure(receive.wait(), structure(1))
            assert receive.poll() is True and receive.wait() is receive.wait()  # done stays done


# ------------------------------------------------------------------ buffers and modification


def test_modifying_after_the_send_completes_does_not_change_what_arrived(comm):
    """Contract (p2p.send docstring): contiguous CPU tensors are sent in place, not copied, so the
    sender modifies them only once its Send is done. (Changed after a check: modifying a 12 MB
    contiguous tensor right after send() returned DID change what arrived, contrary to the old
    "snapshotted" docstring; the executor never modifies what it sent, so the docstring was fixed
    rather than adding a copy per message.)"""
    source, dest = ring(comm)
    receive = p2p.Receive(source, 110, comm)
    comm.Barrier()
    value = make(torch.float32, (3_000_000,), comm.rank)
    send = p2p.send(value, dest, 110, comm)
    got = receive.wait()
    send.wait()
    value.fill_(-1)
    comm.Barrier()
    assert_same(got, make(torch.float32, (3_000_000,), source))


def test_a_small_tensor_is_copied_into_its_message(comm):
    """A plain tensor of at most HEADER_CAPACITY bytes travels in one message with its header, copied in by
    send(): changing it right after send() returns does not change what arrives."""
    source, dest = ring(comm)
    receive = p2p.Receive(source, 112, comm)
    value = make(torch.float32, (1000,), comm.rank)
    send = p2p.send(value, dest, 112, comm)
    value.fill_(-1)
    got = receive.wait()
    send.wait()
    with ranks_agree(comm):
        assert_same(got, make(torch.float32, (1000,), source))


def test_dropped_send_keeps_its_buffers_until_sent(comm):
    """A Send dropped while in flight (its tensor a temporary) used to free the buffers MPI was
    still reading: the sender crashed with a segfault inside MPI. Now they live until sent."""
    source, dest = ring(comm)
    p2p.send(make(torch.float32, (3_000_000,), comm.rank) * 2, dest, 120, comm)  # Send dropped
    gc.collect()
    junk = [torch.full((3_000_000,), 7.0) for _ in range(4)]  # reuse the freed memory, if any
    comm.Barrier()  # progresses the send while the receiver has not posted yet
    got = p2p.Receive(source, 120, comm).wait()
    with ranks_agree(comm):
        assert_same(got, make(torch.float32, (3_000_000,), source) * 2)
    del junk
    comm.Barrier()
    # the dropped send's buffers are released once MPI is done with them (every rank takes the same
    # number of turns: the decision is an allreduce)
    for _ in range(1000):
        if not comm.allreduce(_ext.core().orphaned_transfers()):
            break
        time.sleep(1e-3)
        exchange(comm, None, tag=122)
    assert not _ext.core().orphaned_transfers(), "the dropped send's buffers were never released"


def test_transfers_progress_while_python_holds_the_gil(comm, request):
    """The communication thread retires a dropped send's transfer, the last holder of its buffer (a Python
    object). It used to take the GIL to release it, so while this rank's Python thread computed (holding the
    GIL for up to the switch interval, here made endless) no transfer moved. Now the buffer is handed back at
    the next call into the module that holds the GIL. Rank 0 drops a send to rank 1, which answers only once
    it has it: rank 0 gets the answer inside a pure-Python loop that never lets the GIL go."""
    if request.node.callspec.params["comm"] != "engine":
        pytest.skip("without hp.init the calling thread makes the MPI calls itself")
    if comm.rank == 1:
        got = p2p.Receive(0, 124, comm).wait()
        p2p.send(got * 2, 0, 126, comm).wait()
    elif comm.rank == 0:
        answer = p2p.Receive(1, 126, comm)
        before = sys.getswitchinterval()
        sys.setswitchinterval(1000.0)  # this thread keeps the GIL unless it blocks
        try:
            # dropped: the thread retires it (past HEADER_CAPACITY, so its payload is the tensor itself)
            p2p.send(make(torch.float32, (20000,), 0), 1, 124, comm)
            deadline = time.monotonic() + 20
            while not answer._header_request.done and time.monotonic() < deadline:
                pass  # holds the GIL: only the communication thread can complete the receive
            arrived = answer._header_request.done
        finally:
            sys.setswitchinterval(before)
    with ranks_agree(comm):  # (the others wait there for rank 0's checks)
        if comm.rank == 0:
            assert arrived, "the answer did not arrive while Python held the GIL (the communication thread waited)"
            assert_same(answer.wait(), make(torch.float32, (20000,), 0) * 2)


# ------------------------------------------------------------------ errors


def test_remote_error_raises_instead_of_hanging(comm):
    if comm.rank == 0:
        errors = p2p.receive_error(1, comm)
        data = p2p.Receive(1, 130, comm)
        comm.Barrier()
        with pytest.raises(p2p.RemoteError, match="boom") as error:
            data.wait(abort=[errors])
        assert error.value.source == 1
        assert isinstance(error.value, hp.HybridPipeError)
        with pytest.raises(p2p.RemoteError, match="boom"):  # the error stays raised for later checks
            errors.poll()
        data.cancel()
    elif comm.rank == 1:
        comm.Barrier()
        p2p.send_error("boom", rank=1, dest=0, comm=comm).wait()
    else:
        comm.Barrier()
    comm.Barrier()


def test_long_remote_error_keeps_its_end(comm):
    if comm.rank == 0:
        errors = p2p.receive_error(1, comm)
        with pytest.raises(p2p.RemoteError) as error:
            p2p.Receive(1, 132, comm).wait(abort=[errors])
        text = str(error.value)
        assert text.endswith("the last words") and len(text) == 4000
    elif comm.rank == 1:
        p2p.send_error("x" * 10_000 + "the last words", rank=1, dest=0, comm=comm).wait()
    comm.Barrier()


def test_abort_receive_does_not_fire_without_an_error(comm):
    source, dest = ring(comm)
    errors = p2p.receive_error(source, comm)
    receive = p2p.Receive(source, 134, comm)
    send = p2p.send(structure(comm.rank), dest, 134, comm)
    assert_same_structure(receive.wait(abort=[errors]), structure(source))
    send.wait()
    assert errors.poll() is False
    errors.cancel()
    comm.Barrier()


def test_header_over_capacity_raises_on_the_sender_and_sends_nothing(comm):
    source, dest = ring(comm)
    too_big = {"x": torch.ones(3), "blob": "x" * p2p.HEADER_CAPACITY}
    with pytest.raises(ValueError, match=r"pickles to \d+ bytes, more than HEADER_CAPACITY=65536: pass fewer "
                                         r"tensors / smaller non-tensor values"):
        p2p.send(too_big, dest, 140, comm)
    comm.Barrier()
    # nothing of the failed message is on the wire: the next message on that tag arrives intact,
    # and a header just under the capacity fits
    near = {"x": make(torch.float32, (3,), comm.rank), "blob": "y" * (p2p.HEADER_CAPACITY - 1000)}
    got = exchange(comm, near, tag=140)
    assert_same(got["x"], make(torch.float32, (3,), source))
    assert got["blob"] == near["blob"]


def test_tags_outside_the_range_raise(comm):
    source, dest = ring(comm)
    top = p2p.ERROR_TAG - 2
    for bad in (-1, top + 1, p2p.ERROR_TAG, 10**6):
        message = rf"p2p tag {bad} is outside 0\.\.{top} \(tags below ERROR_TAG={p2p.ERROR_TAG}\)"
        with pytest.raises(ValueError, match=message):
            p2p.send(torch.ones(2), dest, bad, comm)
        with pytest.raises(ValueError, match=message):
            p2p.Receive(source, bad, comm)
    with pytest.raises(ValueError, match=r"p2p tag -3 is outside 0\.\.\d+ \(MPI_TAG_UB of this MPI\)"):
        _ext.core().isend(0, 0, dest, -3, comm.py2f())
    with pytest.raises(ValueError, match=r"p2p tag -3 is outside 0\.\.\d+ \(MPI_TAG_UB of this MPI\)"):
        _ext.core().irecv(0, 0, source, -3, comm.py2f())
    comm.Barrier()
    got = exchange(comm, make(torch.int32, (4,), comm.rank), tag=top)  # the highest tag works
    assert_same(got, make(torch.int32, (4,), source))


def test_cancel_a_receive_that_never_matched(comm):
    source, dest = ring(comm)
    never = p2p.Receive(source, 150, comm)
    never.cancel()
    never.cancel()  # twice is fine
    withdrawn = p2p.Receive(source, 152, comm)
    kept = p2p.Receive(source, 152, comm)
    withdrawn.cancel()  # the earlier of two receives on a tag
    comm.Barrier()  # every rank cancelled before anything is sent
    sends = [p2p.send(make(torch.float32, (5,), comm.rank), dest, tag, comm) for tag in (150, 152)]
    # the messages go to receives posted after the cancels, on the same tags
    assert_same(p2p.Receive(source, 150, comm).wait(), make(torch.float32, (5,), source))
    assert_same(kept.wait(), make(torch.float32, (5,), source))
    for send in sends:
        send.wait()
    kept.cancel()  # after completion: a no-op, the value stays
    assert_same(kept.wait(), make(torch.float32, (5,), source))
    comm.Barrier()



# ------------------------------------------------------------------ who makes the MPI calls (after hp.init)


def _counts_since(before):
    after = _ext.core().transfer_counts()
    return {key: after[key] - before[key] for key in after}


def test_the_calling_thread_posts_and_completes_its_own_transfers(comm, request):
    """After hp.init a thread that needs a transfer makes the MPI calls itself whenever the communication
    thread is not in MPI (it sleeps between cycles nearly all the time when only transfers run): no hand-off
    to the communication thread and back. (How many it makes here depends on the scheduler: with more ranks
    than cores the communication thread is often preempted in MPI, and the transfer goes to it then.)"""
    if request.node.callspec.params["comm"] != "engine":
        pytest.skip("without hp.init the calling thread makes every MPI call anyway")
    before = _ext.core().transfer_counts()
    rounds = 50
    values = []
    for step in range(rounds):
        values.append(exchange(comm, make(torch.float32, (64,), comm.rank + step), tag=160))
    counts = _counts_since(before)
    posted = counts["posted_here"] + counts["posted_by_driver"]
    with ranks_agree(comm):
        for step, got in enumerate(values):
            assert_same(got, make(torch.float32, (64,), ring(comm)[0] + step))
        assert posted >= 2 * rounds, counts  # a header receive and a send per round, at least
        assert counts["posted_here"] > 0, f"the calling thread posted no transfer itself: {counts}"
        assert counts["completed_here"] > 0, f"the calling thread completed no transfer itself: {counts}"


def test_a_transfer_nobody_waits_for_completes_in_the_background(comm, request):
    """A large send (MPI's rendezvous: the sender's side must be progressed) that the sending thread never
    tests or waits for still completes: the communication thread tests what is in flight between its cycles.
    Rank 0 sends and then only sleeps; rank 1 receives. Rank 0's send completes, by the communication thread,
    while rank 0's thread sleeps."""
    if request.node.callspec.params["comm"] != "engine":
        pytest.skip("without hp.init nothing tests a transfer in the background")
    payload = make(torch.float32, (1_000_000,), 7)
    comm.Barrier()
    if comm.rank == 0:
        before = _ext.core().transfer_counts()
        send = p2p.send(payload, 1, 162, comm)
        deadline = time.monotonic() + 30
        while not all(part.done for part in send._requests) and time.monotonic() < deadline:
            time.sleep(0.01)  # `done` only reads the outcome: it makes no MPI call
        sent = all(part.done for part in send._requests)
        counts = _counts_since(before)
    elif comm.rank == 1:
        time.sleep(0.05)  # the send is in flight, unmatched, for a while
        got = p2p.Receive(0, 162, comm).wait()
    with ranks_agree(comm):
        if comm.rank == 0:
            assert sent, "the send never completed while its thread slept"
            assert counts["completed_by_driver"] >= 1, counts
        if comm.rank == 1:
            assert_same(got, payload)


def test_dropped_sends_from_the_calling_thread_keep_their_buffers(comm):
    """Sends posted by the calling thread and dropped at once, their tensors temporaries: each keeps its
    buffer until MPI is done with it, whoever completes it (the calling thread at its next wait or test, the
    communication thread in the background)."""
    source, dest = ring(comm)
    for step in range(20):
        p2p.send(make(torch.float32, (100_000,), comm.rank + step) * 3, dest, 164, comm)  # dropped
    gc.collect()
    junk = [torch.full((100_000,), 5.0) for _ in range(40)]  # reuse the freed memory, if any
    values = [p2p.Receive(source, 164, comm).wait() for _ in range(20)]
    with ranks_agree(comm):
        for step, got in enumerate(values):
            assert_same(got, make(torch.float32, (100_000,), source + step) * 3)
    del junk
    comm.Barrier()
    for _ in range(1000):
        if not comm.allreduce(_ext.core().orphaned_transfers()):
            break
        time.sleep(1e-3)
        exchange(comm, None, tag=166)
    assert not _ext.core().orphaned_transfers(), "the dropped sends' buffers were never released"


def test_transfers_beside_collectives_from_another_thread(comm, request):
    """Under load: a second thread keeps the engine busy with allreduces (the communication thread holds the
    communication lock through its cycles, so transfers are then queued to it) while this thread exchanges
    messages on a ring (posted and tested here whenever the lock is free). Both give the right values, in
    order, and nothing stalls."""
    import threading

    if request.node.callspec.params["comm"] != "engine":
        pytest.skip("the engine's collectives need hp.init")
    failures = []

    def reduce_on():  # the same 100 allreduces on every rank
        try:
            for count in range(100):
                out = hp.allreduce(torch.full((5000,), float(comm.rank + count)), op=hp.Sum, name=f"mixed.{count}")
                want = float(sum(range(comm.size)) + comm.size * count)
                if not torch.equal(out, torch.full((5000,), want)):
                    failures.append(f"allreduce {count}: {out[:3]} != {want}")
        except Exception as error:  # reported by the main thread
            failures.append(repr(error))

    thread = threading.Thread(target=reduce_on)
    thread.start()
    try:
        values = [exchange(comm, make(torch.float32, (256 if step % 2 else 20_000,), comm.rank + step), tag=168)
                  for step in range(200)]
    finally:
        thread.join(timeout=120)
    with ranks_agree(comm):
        assert not thread.is_alive(), "the allreduce thread hung"
        assert not failures, failures
        for step, got in enumerate(values):
            assert_same(got, make(torch.float32, (256 if step % 2 else 20_000,), ring(comm)[0] + step))
