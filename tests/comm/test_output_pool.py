"""The pool of out-of-place allreduce outputs (hybridpipe.comm.buffers.OutputPool), in one process: a result's memory
is given out again only when torch counts no other user of it — not while the result, a view of it, a numpy array on
it or a tensor autograd saved is alive."""

from __future__ import annotations

import numpy as np
import torch

from hybridpipe.comm.buffers import OutputPool


def _handed_out(pool: OutputPool, like):
    out = pool.take(like)
    out[...] = 1
    pool.offer(out)
    return out


def test_a_released_tensor_is_taken_again_and_a_held_one_is_not():
    pool, like = OutputPool(), torch.zeros(3, 4)
    first = _handed_out(pool, like)
    address = first.data_ptr()
    second = pool.take(like)
    assert second.data_ptr() != address and first.sum() == 12  # `first` is still held
    del first
    third = pool.take(like)
    assert third.data_ptr() == address and third.shape == (3, 4) and third.dtype == torch.float32


def test_views_numpy_arrays_and_saved_tensors_keep_a_result_out_of_reuse():
    like = torch.zeros(6)
    for hold in (lambda out: out[2:], lambda out: out.view(2, 3), lambda out: out.numpy(),
                 lambda out: out.numpy()[1:], lambda out: (torch.ones(6, requires_grad=True) * out).grad_fn):
        pool = OutputPool()
        out = _handed_out(pool, like)
        address, holder = out.data_ptr(), hold(out)
        del out
        assert pool.take(like).data_ptr() != address, holder
        del holder
        assert pool.take(like).data_ptr() == address


def test_numpy_results_are_pooled_as_arrays_of_their_dtype():
    for dtype in (np.float32, np.float16, np.int64, np.uint16, np.bool_):
        pool, like = OutputPool(), np.zeros((2, 5), dtype)
        out = _handed_out(pool, like)
        assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == (2, 5)
        address = out.__array_interface__["data"][0]
        view = out[1]
        del out
        assert pool.take(like).__array_interface__["data"][0] != address
        del view
        again = pool.take(like)
        assert isinstance(again, np.ndarray) and again.__array_interface__["data"][0] == address


def test_the_pool_keeps_at_most_its_limit_and_lets_the_oldest_go():
    pool, like = OutputPool(limit_bytes=3 * 400), torch.zeros(100)  # room for three results of 400 bytes
    held = [_handed_out(pool, like) for _ in range(5)]  # five different memories, all held
    addresses = [out.data_ptr() for out in held]
    assert len(set(addresses)) == 5
    del held
    again = [pool.take(like) for _ in range(5)]
    assert [out.data_ptr() for out in again[:3]] == addresses[2:]  # the newest three, oldest first
