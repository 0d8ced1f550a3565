"""Horovod's training helpers under ``import hybridpipe as hvd``: DistributedOptimizer's options
(gradient_predivide_factor, groups / num_groups, sparse_as_dense, a custom compressor, op=Adasum refused),
the broadcast helpers' name= / process_set= keywords and tensor hyper-parameters, and SyncBatchNorm
against one-process BatchNorm on the global batch.

Every rank builds every rank's data from the rank number, so the references need no communication. A test's
collectives come first in each ``ranks_agree`` block and its checks after them, so that a check failing on one
rank fails every rank there, with that rank's message, instead of leaving the others in the next collective.
"""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hvd
from agree import ranks_agree

pytestmark = pytest.mark.mpi(ranks=[2], timeout=240, shared=True)

torch.set_num_threads(1)
N, R = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(6, 4, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def per_rank_gradients(rank: int) -> dict[str, torch.Tensor]:
    reference = model()
    x, y = batch(rank)
    nn.functional.cross_entropy(reference(x), y).backward()
    return {name: parameter.grad for name, parameter in reference.named_parameters()}


def averaged_gradients() -> dict[str, torch.Tensor]:
    """The mean over ranks of each rank's gradient, computed here for every rank."""
    total: dict[str, torch.Tensor] = {}
    for rank in range(N):
        reference = model()
        x, y = batch(rank)
        nn.functional.cross_entropy(reference(x), y).backward()
        for name, parameter in reference.named_parameters():
            total[name] = total.get(name, 0) + parameter.grad / N
    return total


def gradients_after_synchronize(**options) -> dict[str, torch.Tensor]:
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters(), **options)
    x, y = batch(R)
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.synchronize()
    return {name: parameter.grad.clone() for name, parameter in net.named_parameters()}


def assert_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tolerance) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tolerance, msg=name)


# ------------------------------------------------------------------ DistributedOptimizer options


def test_gradient_predivide_factor_groups_and_custom_compression_average_as_plain():
    want = averaged_gradients()
    with ranks_agree(what="gradient_predivide_factor, num_groups"):
        predivided = gradients_after_synchronize(gradient_predivide_factor=4.0)
        in_groups = gradients_after_synchronize(num_groups=2)
        assert_gradients(predivided, want)
        assert_gradients(in_groups, want)
    net = model()
    first, second = net[0], net[2]
    with ranks_agree(what="groups="):
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                             named_parameters=net.named_parameters(),
                                             groups=[[first.weight, first.bias], [second.weight]])
        x, y = batch(R)
        nn.functional.cross_entropy(net(x), y).backward()
        in_flight = optimizer.in_flight()
        optimizer.synchronize()
        assert in_flight == ["0.bias", "0.weight", "2.bias", "2.weight"]  # every hook fired
        assert_gradients({name: p.grad for name, p in net.named_parameters()}, want)

    class Doubling:  # Horovod's compressor interface: compress -> (tensor, ctx), decompress(tensor, ctx)
        @staticmethod
        def compress(tensor):
            return tensor * 2, tensor.dtype

        @staticmethod
        def decompress(tensor, ctx):
            return (tensor / 2).to(ctx)

    with ranks_agree(what="compression=, op=Sum, op=Adasum"):
        compressed = gradients_after_synchronize(compression=Doubling())
        sums = gradients_after_synchronize(op=hvd.Sum)
        adasum = gradients_after_synchronize(op=hvd.Adasum)  # each gradient combined by Adasum (2 ranks: a pair)
        assert_gradients(compressed, want)
        assert_gradients(sums, {name: grad * N for name, grad in want.items()})
        for name, grad in adasum.items():
            a, b = (per_rank_gradients(r)[name].double().reshape(-1) for r in range(2))
            pair = a * (1 - a @ b / (2 * (a @ a))) + b * (1 - a @ b / (2 * (b @ b)))
            torch.testing.assert_close(grad.double().reshape(-1), pair, msg=name)


def test_optimizer_argument_errors_are_horovods():
    net = model()
    with ranks_agree(what="op=Max"), pytest.raises(
            ValueError, match=r"op must be hp.Average, hp.Sum or hp.Adasum \(got Max\)"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=hvd.Max)
    with ranks_agree(what="gradient_predivide_factor with op=Sum"), pytest.raises(
            ValueError, match=r"gradient_predivide_factor is only supported with op=hp.Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2)
    with ranks_agree(what="groups= with a foreign tensor"), pytest.raises(
            ValueError, match=r"groups\[0\] holds a tensor that is not a parameter of the optimizer"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), groups=[[torch.ones(2)]])
    with ranks_agree(what="compression='fp16'"), pytest.raises(
            TypeError, match=r"compression must be hp.Compression.none / fp16 / bf16 or an object"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), compression="fp16")
    with ranks_agree(what="group= and process_set="), pytest.raises(
            ValueError, match=r"pass the ranks as group= or as process_set=, not both"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), group="world",
                                 process_set=hvd.global_process_set)


def test_sparse_gradients_as_dense():
    def embedding():
        torch.manual_seed(1)
        return nn.Embedding(8, 3, sparse=True)

    rows = [torch.tensor([r, r + 1, 5]) for r in range(N)]
    want = 0
    for rank in range(N):
        reference = embedding()
        (reference(rows[rank]) * torch.arange(3.0)).sum().backward()
        want = want + reference.weight.grad.to_dense() / N
    net = embedding()
    with ranks_agree(what="sparse_as_dense=True"):
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                             named_parameters=net.named_parameters(), sparse_as_dense=True,
                                             process_set=hvd.global_process_set)
        (net(rows[R]) * torch.arange(3.0)).sum().backward()
        optimizer.synchronize()
        assert net.weight.grad.is_sparse  # reduced dense, then back in the gradient's sparse layout (as Horovod)
        torch.testing.assert_close(net.weight.grad.to_dense(), want)

    net = embedding()  # sparse gradients stay sparse: hp.sparse_allreduce_async (allgather of indices and values)
    with ranks_agree(what="sparse gradients"):
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                             named_parameters=net.named_parameters())
        (net(rows[R]) * torch.arange(3.0)).sum().backward()
        optimizer.step()
        assert net.weight.grad.is_sparse
        torch.testing.assert_close(net.weight.grad.to_dense(), want)


def test_sparse_allreduce_async_gathers_indices_and_values():
    dense = torch.zeros(5, 2)
    dense[R] = torch.tensor([1.0, 2.0]) * (R + 1)
    dense[4] = 1.0
    want = torch.zeros(5, 2)
    for r in range(N):
        want[r] = torch.tensor([1.0, 2.0]) * (r + 1)
    want[4] = float(N)
    with ranks_agree(what="sparse_allreduce_async"):
        handle = hvd.sparse_allreduce_async(dense.to_sparse(1), name="sparse", op=hvd.Sum)
        result = hvd.synchronize(handle)
        averaged = hvd.sparse_allreduce_async(dense.to_sparse(1), name="sparse.mean").wait()
        assert result.is_sparse and result._nnz() == 2 * N  # every rank's entries, as Horovod's
        torch.testing.assert_close(result.to_dense(), want)
        torch.testing.assert_close(averaged.to_dense(), want / N)
    with ranks_agree(what="a dense tensor"), pytest.raises(TypeError, match=r"takes a sparse COO torch tensor"):
        hvd.sparse_allreduce_async(dense, name="dense")


# ------------------------------------------------------------------ broadcasts


def test_broadcast_helpers_take_name_and_process_set_and_tensor_hyper_parameters():
    with ranks_agree(what="broadcast_object, allgather_object"):
        who = hvd.broadcast_object({"rank": R}, root_rank=N - 1, name="who", process_set=hvd.global_process_set)
        tens = hvd.allgather_object(R * 10, name="tens", process_set=hvd.global_process_set)
        assert who == {"rank": N - 1}
        assert tens == [r * 10 for r in range(N)]
    with ranks_agree(what="names differing across ranks"), pytest.raises(hvd.MismatchError):
        hvd.broadcast_object(1, name=f"rank{R}")  # names are checked across ranks
    net = model()
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(R)
    expected = model()
    with ranks_agree(what="broadcast_parameters"):
        hvd.broadcast_parameters(net.state_dict(), root_rank=N - 1, process_set=hvd.global_process_set)
        for (name, got), want in zip(net.state_dict().items(), expected.state_dict().values()):
            torch.testing.assert_close(got, want + (N - 1), msg=name)

    optimizer = torch.optim.SGD(net.parameters(), lr=torch.tensor(0.1 * (R + 1)), momentum=0.5 + 0.1 * R)
    x, y = batch(R)
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()  # momentum buffers differ per rank
    root_state = copy.deepcopy(optimizer.state_dict()) if R == 1 else None
    with ranks_agree(what="broadcast_optimizer_state"):
        hvd.broadcast_optimizer_state(optimizer, root_rank=1, process_set=hvd.global_process_set)
        root_state = hvd.broadcast_object(root_state, root_rank=1)
        group = optimizer.state_dict()["param_groups"][0]
        assert torch.is_tensor(group["lr"]) and float(group["lr"]) == pytest.approx(0.2)
        assert group["momentum"] == pytest.approx(0.6)
        for index, state in optimizer.state_dict()["state"].items():
            torch.testing.assert_close(state["momentum_buffer"], root_state["state"][index]["momentum_buffer"])


# ------------------------------------------------------------------ SyncBatchNorm


@pytest.mark.parametrize("shape", [(3,), (3, 4)], ids=["1d", "2d-spatial"])
def test_sync_batch_norm_equals_one_process_batch_norm_on_the_global_batch(shape):
    rows = [3, 5][:N] + [4] * max(0, N - 2)  # uneven: ranks hold different numbers of rows
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(sum(rows), *shape, generator=generator, dtype=torch.float64) * 3 + 5
    weights = torch.randn(sum(rows), *shape, generator=generator, dtype=torch.float64)
    start = sum(rows[:R])
    mine = slice(start, start + rows[R])

    reference = nn.BatchNorm1d(3).double() if len(shape) == 1 else nn.BatchNorm2d(3).double()
    with torch.no_grad():
        reference.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        reference.bias.copy_(torch.tensor([0.0, -1.0, 1.0]))
    synced = hvd.SyncBatchNorm(3).double()
    synced.load_state_dict(reference.state_dict())
    if len(shape) == 2:
        x, weights = x.unsqueeze(-1), weights.unsqueeze(-1)  # (N, C, 4, 1): BatchNorm2d's shape

    x_all = x.clone().requires_grad_(True)
    y_all = reference(x_all)
    (y_all * weights).sum().backward()

    x_mine = x[mine].clone().requires_grad_(True)
    with ranks_agree(what="SyncBatchNorm"):
        y_mine = synced(x_mine)
        (y_mine * weights[mine]).sum().backward()
        # each rank holds its part of the parameter gradients: their sum is one process's
        weight_grad = hvd.allreduce(synced.weight.grad, op=hvd.Sum)
        bias_grad = hvd.allreduce(synced.bias.grad, op=hvd.Sum)
        running_mean, running_var = synced.running_mean.clone(), synced.running_var.clone()
        synced.eval()
        reference.eval()
        evaluated = synced(x[mine])
        torch.testing.assert_close(y_mine, y_all[mine].detach())
        torch.testing.assert_close(x_mine.grad, x_all.grad[mine])
        torch.testing.assert_close(weight_grad, reference.weight.grad)
        torch.testing.assert_close(bias_grad, reference.bias.grad)
        torch.testing.assert_close(running_mean, reference.running_mean)
        torch.testing.assert_close(running_var, reference.running_var)
        torch.testing.assert_close(evaluated, reference(x[mine]))


# ------------------------------------------------------------------ join


def test_join_completes_the_others_allreduces_with_zeros_and_returns_the_last_rank():
    last_rank = N - 1  # the rank that runs out of data first; the others go on
    # every rank's checks wait for every rank's join (a rank in hp.join takes no part in ranks_agree's gather);
    # the ranks that go on join in `finally`, so that a failure among their steps cannot leave the others in join
    if R == last_rank:
        joined = hvd.join()
        with ranks_agree(what="join"):
            assert joined == 0 if N == 2 else isinstance(joined, int)
        return
    x = torch.full((3,), float(R + 1))
    contributing = range(N - 1)
    mean = sum(r + 1 for r in contributing) / N  # Average divides by the group's size, as Horovod's
    with ranks_agree(what="join"):
        try:
            summed = hvd.allreduce(x, op=hvd.Sum)
            averaged = hvd.allreduce(x, name="sync.mean")
            waited = hvd.allreduce_async(x, name="async.mean").wait()
            y = x.clone()
            hvd.allreduce_async_(y, name="async.sum", op=hvd.Sum).wait()
            with pytest.raises(hvd.HorovodInternalError, match=r"have joined \(hp.join\)"):
                hvd.broadcast(x, root_rank=0)
            # a training step of the ranks that still have data: their gradients' sum over the group's size
            net = model()
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                                 named_parameters=net.named_parameters())
            xb, yb = batch(R)
            nn.functional.cross_entropy(net(xb), yb).backward()
            local = {name: p.grad.clone() for name, p in net.named_parameters()}
            optimizer.step()
        finally:
            joined = hvd.join()
        assert summed.tolist() == [float(sum(r + 1 for r in contributing))] * 3
        assert averaged.tolist() == pytest.approx([mean] * 3)
        assert waited.tolist() == pytest.approx([mean] * 3)
        assert y.tolist() == [float(sum(r + 1 for r in contributing))] * 3
        if N == 2:
            for name, p in net.named_parameters():
                torch.testing.assert_close(p.grad, local[name] / N, msg=name)
        assert joined == 0 if N == 2 else isinstance(joined, int)


def test_join_everywhere_then_collectives_work_again():
    joined = hvd.join()
    total = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    with ranks_agree():
        assert joined in range(N)
        assert total.tolist() == [float(N)] * 2


def test_cross_rank_cross_size_and_homogeneity_on_one_host():
    hosts = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())
    with ranks_agree():
        if len(set(hosts)) == 1:  # every rank here: each is alone among the ranks with its local rank
            assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
        assert 0 <= hvd.cross_rank() < hvd.cross_size() <= N


# ------------------------------------------------------------------ compression on the wire


def _wire_bytes_of(work) -> int:
    """Bytes this rank handed to MPI while ``work()`` ran on the communication thread."""
    from hybridpipe import _ext
    from hybridpipe.comm import context

    def measured():
        before = _ext.core().wire_bytes_sent()
        work()
        return _ext.core().wire_bytes_sent() - before

    return context.call(None, "test", measured)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_travels_as_16_bit_in_the_ring_and_the_library_path(dtype):
    from hybridpipe import _ext
    from hybridpipe.comm import buffers, context

    core = _ext.core()
    comm = context.current("test").grid.world_comm
    options = core.AllreduceOptions()
    count = 1 << 15  # 64 KiB of halves: the ring when asked for it
    values = [torch.linspace(-2, 2, count) * (r + 1) for r in range(N)]
    for algorithm, per_rank in [(core.AllreduceAlgorithm.Ring, 2 * (N - 1) * (count // N)),
                                (core.AllreduceAlgorithm.Library, count)]:
        x = values[R].to(dtype)
        want = sum(v.to(dtype).float() for v in values).to(dtype)
        with ranks_agree(what=str(algorithm)):
            sent = _wire_bytes_of(lambda: core.allreduce(x.data_ptr(), x.data_ptr(), count, buffers.dtype_code(x),
                                                         0, comm.py2f(), options, [], algorithm))
            assert sent == per_rank * 2, (algorithm, sent)  # 2 bytes an element: float32 partial sums would be 4
            torch.testing.assert_close(x, want, rtol=1e-2, atol=1e-2)
    # the public API: a small tensor compressed to fp16 moves half the bytes of the float32 one (these ranks share
    # a host: .forced; the plain spelling leaves them float32 there)
    small = torch.linspace(0, 1, 1000)
    with ranks_agree(what="compression=fp16"):
        plain = _wire_bytes_of(lambda: hvd.allreduce(small, op=hvd.Sum))
        compressed = _wire_bytes_of(lambda: hvd.allreduce(small, op=hvd.Sum, compression=hvd.Compression.fp16.forced))
        assert compressed * 2 == plain == 4000


# ------------------------------------------------------------------ out-of-place allreduce_async


def test_out_of_place_async_reuses_only_outputs_nobody_holds():
    x = torch.arange(6.0) + R
    want = (torch.arange(6.0) * N + sum(range(N))).tolist()
    with ranks_agree(what="an output still held"):
        first = hvd.allreduce_async(x, name="oop", op=hvd.Sum).wait()
        held = first.data_ptr()
        second = hvd.allreduce_async(x, name="oop", op=hvd.Sum).wait()
        assert second.data_ptr() != held and first.tolist() == want == second.tolist()  # `first` is still ours
    view = second[2:]
    del first, second
    with ranks_agree(what="an output released"):
        third = hvd.allreduce_async(x, name="oop", op=hvd.Sum).wait()
        assert third.data_ptr() == held  # released: its memory is the output again
        assert view.tolist() == want[2:]  # a view keeps its base out of reuse
    with ranks_agree(what="an output held by a view"):
        fourth = hvd.allreduce_async(x, name="oop", op=hvd.Sum).wait()
        assert fourth.data_ptr() not in (held, view.data_ptr() - 8) and fourth.tolist() == want
        assert torch.equal(x, torch.arange(6.0) + R)  # the input is only read


# ------------------------------------------------------------------ elastic


def test_elastic_rolls_back_to_the_last_commit_and_resumes_from_its_checkpoint(tmp_path_factory, monkeypatch):
    directory = hvd.broadcast_object(str(tmp_path_factory.mktemp("elastic")) if R == 0 else None, group="world")
    monkeypatch.setenv("HYBRIDPIPE_CHECKPOINT_DIR", directory)  # as hybridpipe-run --checkpoint-dir sets it
    net = model()
    initial = {name: p.detach().clone() for name, p in net.named_parameters()}
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)  # rank r: r, r + 2, ...
    state = hvd.elastic.TorchState(net, torch.optim.SGD(net.parameters(), lr=0.1), sampler=sampler, epoch=0)
    attempts, resets, shards = [], [], []
    state.register_reset_callbacks([lambda: resets.append(state.epoch)])

    @hvd.elastic.run
    def train(state):
        attempts.append(state.epoch)
        shards.append(list(state.sampler))  # what is left of the epoch, this rank's share
        position = 0
        while state.epoch < 3:
            state.sampler.record_batch(position, 1)  # one sample a step, recorded before its commit
            position += 1
            with torch.no_grad():
                for parameter in state.model.parameters():
                    parameter.add_(1.0)
            if state.epoch == 1 and len(attempts) == 1:
                hvd.allreduce(torch.ones(2 + R))  # the ranks disagree: a HorovodInternalError on every rank
            state.epoch += 1
            state.commit()
        return state.epoch

    with ranks_agree(what="the rolled-back run"):
        epochs = train(state)
        assert epochs == 3
        assert attempts == [0, 1] and resets == [1]  # the retry starts from the commit after epoch 0
        for name, parameter in net.named_parameters():  # three epochs applied, not four: the failed one rolled back
            torch.testing.assert_close(parameter.detach(), initial[name] + 3, msg=name)
        # the retry's shard leaves out what both ranks processed before the commit (synced: the union), not what
        # the failed step recorded after it
        assert shards == [list(range(R, 10, 2)), list(range(2 + R, 10, 2))], shards

    restarted = model()  # a restarted job: fresh processes build the model again, run() resumes the commit
    with ranks_agree(what="the resumed run"):
        fresh = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
        again = hvd.elastic.TorchState(restarted, torch.optim.SGD(restarted.parameters(), lr=0.1), sampler=fresh,
                                       epoch=0)
        resumed = hvd.elastic.run(lambda state: state.epoch)(again)
        assert resumed == 3
        assert fresh.processed_indices == set(range(6)) and list(fresh) == list(range(6 + R, 10, 2))
        for name, parameter in restarted.named_parameters():
            torch.testing.assert_close(parameter.detach(), initial[name] + 3, msg=name)
