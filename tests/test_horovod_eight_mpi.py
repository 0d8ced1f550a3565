"""Eight behaviours of Horovod 0.28.1's torch API under ``import hybridpipe as hvd``: a joined rank's
zeros in an ``hvd.Average`` (divided by the group's size, or by the contributors with
``HYBRIDPIPE_JOIN_AVERAGE=contributors``), the sparse async handle called for its result, ``_parameter_names``
of an optimizer built without ``named_parameters``, ranks outside an optimizer's process set, sparse gradients
through SparseAdam, the warning of ``step()`` after ``synchronize()``, and ``broadcast_optimizer_state`` of a
fresh optimizer whose parameters have no gradient yet.

Every rank builds every rank's inputs from the rank number, so the references are computed here, with plain
torch, without communication. Collectives come before each ``ranks_agree`` block, checks inside it.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from mpi4py import MPI
from torch import nn

import hybridpipe as hvd
from agree import ranks_agree
from hybridpipe.comm import context

pytestmark = pytest.mark.mpi(ranks=[2], timeout=180, shared=True)

torch.set_num_threads(1)
N, R = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


def rank_tensor(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(50 + rank)
    return torch.randn(6, 5, generator=generator), torch.randn(6, 3, generator=generator)


def local_gradients(rank: int) -> dict[str, torch.Tensor]:
    """``rank``'s gradients of the mlp on its own batch, computed in this process."""
    net = mlp()
    x, y = rank_batch(rank)
    nn.functional.mse_loss(net(x), y).backward()
    return {name: p.grad for name, p in net.named_parameters()}


# ------------------------------------------------------------------ join: what an Average divides by


JOIN_CASES = [(torch.int32, (5,)), (torch.int64, (5, 5)), (torch.float32, (17,)), (torch.float64, (3, 4, 2))]


def _join_round(tag: str) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The last rank joins at once; the others average JOIN_CASES (async and sync) and one optimizer step with
    it joined, then join. Returns (what join returned, results, gradients after the step) on this rank."""
    joined = N - 1
    results: dict[str, torch.Tensor] = {}
    gradients: dict[str, torch.Tensor] = {}
    net = mlp()  # built on every rank: ranks number their optimizers alike
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters())
    if R != joined:
        for index, (dtype, shape) in enumerate(JOIN_CASES):
            tensor = rank_tensor(R, shape, dtype)
            results[f"async{index}"] = hvd.synchronize(hvd.allreduce_async(tensor, name=f"{tag}.{index}",
                                                                           op=hvd.Average))
            results[f"sync{index}"] = hvd.allreduce(tensor, name=f"{tag}.sync.{index}", op=hvd.Average)
        x, y = rank_batch(R)
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.synchronize()
        gradients = {name: p.grad.clone() for name, p in net.named_parameters()}
    return hvd.join(), results, gradients


def _check_join_round(last: int, results: dict, gradients: dict, divisor: int) -> None:
    lasts = hvd.allgather_object(last, name="join.last")
    with ranks_agree(what=f"join, divided by {divisor}"):
        assert lasts == [lasts[0]] * N and lasts[0] != N - 1  # the same everywhere; not the rank that joined first
        if R == N - 1:
            return
        for index, (dtype, shape) in enumerate(JOIN_CASES):
            total = sum(rank_tensor(r, shape, dtype).double() for r in range(N - 1))  # the joined rank adds zeros
            want = (torch.trunc(total / divisor) if not dtype.is_floating_point else total / divisor).to(dtype)
            for kind in ("async", "sync"):
                got = results[f"{kind}{index}"]
                assert got.dtype == dtype and torch.equal(got, want), (kind, dtype, got, want)
        each = [local_gradients(r) for r in range(N - 1)]
        for name, grad in gradients.items():
            torch.testing.assert_close(grad, sum(g[name] for g in each) / divisor, msg=name)


def test_join_average_divides_by_the_group_size_as_horovod():
    """Horovod's test_horovod_join_allreduce: the ranks that did not join get ``tensor * (size - 1) / size``
    when every rank holds the same tensor; here each rank's own, so the sum over them divided by the size."""
    assert context.current("test").config.join_average == "size"  # the default
    last, results, gradients = _join_round("join.size")
    _check_join_round(last, results, gradients, divisor=N)


def test_join_average_over_the_contributors_with_the_setting():
    """HYBRIDPIPE_JOIN_AVERAGE=contributors (Config.join_average): the mean over the ranks that still have data."""
    ctx = context.current("test")
    saved = ctx.config
    ctx.config = dataclasses.replace(saved, join_average="contributors")
    try:
        last, results, gradients = _join_round("join.contributors")
    finally:
        ctx.config = saved
    _check_join_round(last, results, gradients, divisor=N - 1)


# ------------------------------------------------------------------ the sparse handle is called


def rank_sparse(rank: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + index)
    dense = torch.rand(7 + index, 4, generator=generator)
    dense[dense < 0.7] = 0
    return dense.to_sparse()


def test_sparse_allreduce_async_handle_is_called_for_its_result():
    """Horovod's test_async_sparse_allreduce(_process_sets): ``handle()`` returns the reduced sparse tensor."""
    sets = [hvd.add_process_set([r for r in range(N) if r % 2 == parity]) for parity in (0, 1)]
    mine = sets[R % 2]
    try:
        handles = {(label, i): hvd.sparse_allreduce_async(rank_sparse(R, i), name=f"sparse.{label}.{i}",
                                                          op=hvd.Average, process_set=ps)
                   for label, ps in (("world", hvd.global_process_set), ("set", mine)) for i in range(3)}
        called = {key: handle() for key, handle in handles.items()}
        again = {key: hvd.synchronize(handle) for key, handle in handles.items()}
    finally:
        for ps in reversed(sets):
            hvd.remove_process_set(ps)
    with ranks_agree(what="sparse handle()"):
        for (label, i), result in called.items():
            members = range(N) if label == "world" else mine.ranks
            want = sum(rank_sparse(r, i).to_dense() for r in members) / len(members)
            assert result.is_sparse and again[(label, i)] is result
            torch.testing.assert_close(result.to_dense(), want, msg=f"{label} {i}")


# ------------------------------------------------------------------ DistributedOptimizer


def test_optimizer_without_named_parameters_exposes_the_names_it_gave():
    """Horovod's test_optimizer_no_named_parameters: ``_parameter_names`` maps each parameter to a unique name,
    the same on every rank, under which its gradient is reduced."""
    net = mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([{"params": net[0].parameters()},
                                                          {"params": net[2].parameters(), "lr": 0.05}], lr=0.1))
    names = optimizer._parameter_names
    x, y = rank_batch(R)
    nn.functional.mse_loss(net(x), y).backward()
    in_flight = optimizer.in_flight()  # the hooks queued each gradient under its name
    optimizer.synchronize()
    everyone = hvd.allgather_object(sorted(names.values()))
    with ranks_agree(what="_parameter_names"):
        assert set(map(id, names)) == {id(p) for p in net.parameters()}
        assert len(set(names.values())) == len(names) == 4
        assert everyone == [everyone[0]] * N
        assert in_flight == sorted(names.values())
        each = [local_gradients(r) for r in range(N)]
        for name, parameter in net.named_parameters():
            torch.testing.assert_close(parameter.grad, sum(g[name] for g in each) / N, msg=name)


def test_optimizer_over_a_process_set_is_built_and_stepped_outside_it():
    """Horovod's test_optimizer_process_sets: the optimizer of a set that excludes this rank steps with this
    rank's own gradients; the set's ranks average among themselves."""
    even = hvd.add_process_set([r for r in range(N) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(N) if r % 2 == 1])
    inside = even.included()
    members = even.ranks if inside else [R]
    try:
        net = mlp()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9),
                                             named_parameters=net.named_parameters(), process_set=even)
        x, y = rank_batch(R)
        for _ in range(2):
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            in_flight = optimizer.in_flight()
            optimizer.step()
        refused = None
        if not inside:
            try:
                hvd.DistributedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), process_set=even, zero=1)
            except ValueError as error:
                refused = str(error)
    finally:
        hvd.remove_process_set(odd)
        hvd.remove_process_set(even)
    with ranks_agree(what="optimizer outside its process set"):
        reference = mlp()
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
        copies = [copy.deepcopy(reference) for _ in members]
        for _ in range(2):  # one-process reference: the mean of the members' gradients, each at the same weights
            for member, model in zip(members, copies):
                model.load_state_dict(reference.state_dict())
                model.zero_grad()
                nn.functional.mse_loss(model(rank_batch(member)[0]), rank_batch(member)[1]).backward()
            for name, parameter in reference.named_parameters():
                parameter.grad = sum(dict(m.named_parameters())[name].grad for m in copies) / len(members)
            reference_optimizer.step()
        for (name, got), want in zip(net.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, msg=name)
        if not inside:
            assert in_flight == []  # no hooks: nothing is reduced on a rank outside the set
            assert refused is not None and f"rank {R} is not in the process set" in refused and "zero=0" in refused


def embedding_input(rank: int) -> torch.Tensor:
    return torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if rank == 0 else torch.tensor([[1, 3, 4], [4, 7, 9]])


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_gradients_stay_sparse_through_sparse_adam(sparse_as_dense):
    """Horovod's test_sparse_embeddings: SparseAdam steps on the averaged gradient, which stays sparse."""
    def embedding() -> nn.Embedding:
        torch.manual_seed(2)
        return nn.Embedding(10, 3, sparse=True)

    net = embedding()
    optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(net.parameters()), lr=0.1),
                                         sparse_as_dense=sparse_as_dense)
    optimizer.zero_grad()
    net(embedding_input(R)).sum().backward()
    optimizer.step()
    with ranks_agree(what=f"SparseAdam, sparse_as_dense={sparse_as_dense}"):
        want_grad = 0
        for rank in range(N):
            reference = embedding()
            reference(embedding_input(rank)).sum().backward()
            want_grad = want_grad + reference.weight.grad.to_dense() / N
        assert net.weight.grad.is_sparse
        torch.testing.assert_close(net.weight.grad.to_dense(), want_grad)
        reference = embedding()
        reference.weight.grad = want_grad.to_sparse(1)
        torch.optim.SparseAdam(list(reference.parameters()), lr=0.1).step()
        torch.testing.assert_close(net.weight, reference.weight)


def test_step_after_synchronize_warns_and_does_not_reduce_again():
    """Horovod's test_synchronize_step_warning; with op=hvd.Sum a second reduction would show as N times the sum."""
    net = mlp()
    weights = {name: p.detach().clone() for name, p in net.named_parameters()}
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters(), op=hvd.Sum)
    x, y = rank_batch(R)
    nn.functional.mse_loss(net(x), y).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    optimizer.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        with optimizer.skip_synchronize():
            optimizer.step()
    with ranks_agree(what="step() after synchronize()"):
        assert len(caught) == 1 and caught[0].category is UserWarning
        assert "optimizer.step() called without optimizer.skip_synchronize()" in str(caught[0].message)
        assert quiet == []
        each = [local_gradients(r) for r in range(N)]
        reference = mlp()
        for name, p in reference.named_parameters():
            assert torch.equal(p.detach(), weights[name])
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for name, p in reference.named_parameters():  # step 1: the sum over ranks, once
            p.grad = sum(g[name] for g in each)
        reference_optimizer.step()
        moved = copy.deepcopy(reference)
        grads_at_step_2 = []
        for rank in range(N):
            model = copy.deepcopy(moved)
            nn.functional.mse_loss(model(rank_batch(rank)[0]), rank_batch(rank)[1]).backward()
            grads_at_step_2.append({name: p.grad for name, p in model.named_parameters()})
        for name, p in reference.named_parameters():
            p.grad = sum(g[name] for g in grads_at_step_2)
        reference_optimizer.step()
        for (name, got), want in zip(net.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, msg=name)


class ModelNoGrad(nn.Module):
    """Horovod's test model: a frozen integer index parameter and a trainable vector."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7 + R)  # different everywhere until broadcast
        self.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = nn.Parameter(torch.rand(4, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.a.long()) * x


def test_broadcast_optimizer_state_gives_fresh_parameters_zero_gradients():
    """Horovod's test_broadcast_state_no_grad: after broadcast_optimizer_state of an optimizer that has not
    stepped, the trainable parameters hold zero gradients (broadcastable), the frozen one none; nothing moved."""
    model = ModelNoGrad()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grad = optimizer.param_groups[0]["params"][1].grad
    from_root = hvd.broadcast(grad, root_rank=0, name="no_grad.b") if grad is not None else None
    sparse_net = nn.Embedding(6, 2, sparse=True)
    sparse_optimizer = torch.optim.SparseAdam(list(sparse_net.parameters()), lr=0.1)
    hvd.broadcast_optimizer_state(sparse_optimizer, root_rank=0)
    adam_grad = sparse_net.weight.grad
    embedding_sgd = torch.optim.SGD(sparse_net.parameters(), lr=0.1)
    sparse_net.weight.grad = None
    hvd.broadcast_optimizer_state(embedding_sgd, root_rank=0, model=sparse_net)
    sgd_grad = sparse_net.weight.grad
    # an optimizer whose root has state: the state travels, no gradient is made up
    stepped = nn.Linear(2, 2)
    stepped_optimizer = torch.optim.SGD(stepped.parameters(), lr=0.1, momentum=0.9)
    stepped(torch.ones(1, 2)).sum().backward()
    stepped_optimizer.step()
    stepped.zero_grad(set_to_none=True)
    hvd.broadcast_optimizer_state(stepped_optimizer, root_rank=0)
    with ranks_agree(what="broadcast_optimizer_state, no gradients yet"):
        generator = torch.Generator().manual_seed(7)  # rank 0's initial b
        assert optimizer.param_groups[0]["params"][0].grad is None
        assert grad is not None and torch.equal(grad, torch.zeros(4)) and torch.equal(grad, from_root)
        assert torch.equal(model.b.detach(), torch.rand(4, generator=generator))  # not stepped: weight decay idle
        assert optimizer.state_dict()["state"] == {}
        assert adam_grad is not None and adam_grad.is_sparse and adam_grad._nnz() == 0
        assert adam_grad.shape == sgd_grad.shape == (6, 2)
        assert sparse_net.weight.grad is sgd_grad and sgd_grad.is_sparse and sgd_grad._nnz() == 0
        assert all(p.grad is None for p in stepped.parameters())
        assert len(stepped_optimizer.state_dict()["state"]) == 2
