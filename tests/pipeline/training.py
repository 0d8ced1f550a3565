"""Helpers shared by the pipeline MPI tests (not a test file): small models, data, one-process references."""

from __future__ import annotations

import torch
from torch import nn

import hybridpipe as hp


# ------------------------------------------------------------------ models (every layer takes one value)

def mlp(width: int = 12, depth: int = 4, classes: int = 5) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class Embed(nn.Module):
    """ids → {"h": embeddings, "mask": padding mask (bool, no grad), "ids": the int ids}."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(16, dim) * 0.1)

    def forward(self, ids: torch.Tensor) -> dict:
        h = self.tokens(ids) + self.positions[: ids.shape[1]]
        return {"h": h, "mask": ids == 0, "ids": ids}


class Block(nn.Module):
    """Pre-norm attention + MLP block; reads the mask that travels with the activations."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, value: dict) -> dict:
        h, mask = value["h"], value["mask"]
        x = self.norm1(h)
        attended, _ = self.attention(x, x, x, key_padding_mask=mask, need_weights=False)
        h = h + attended
        h = h + self.mlp(self.norm2(h))
        return {**value, "h": h}


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, value: dict) -> torch.Tensor:
        # uses the int ids too: a non-float tensor that crossed every stage
        return self.out(self.norm(value["h"])) + (value["ids"] == 1).unsqueeze(-1).float()


def transformer(vocab: int = 11, dim: int = 8, blocks: int = 3) -> nn.Sequential:
    return nn.Sequential(Embed(vocab, dim), *[Block(dim) for _ in range(blocks)], Head(dim, vocab))


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv2(torch.relu(self.norm(self.conv1(x)))))


class ToTuple(nn.Module):
    """Passes (features, a constant no-grad scale) as a tuple to the next stage."""

    def forward(self, x: torch.Tensor) -> tuple:
        return x, torch.full((x.shape[0], 1), 0.5)


class FromTuple(nn.Module):
    def forward(self, value: tuple) -> torch.Tensor:
        x, scale = value
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 2), 1) * (1 + scale)


def cnn(channels: int = 4, classes: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), Residual(channels), Residual(channels),
                         ToTuple(), FromTuple(), nn.Linear(4 * channels, classes))


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(kind: str, steps: int = 3, batch: int = 10, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "mlp":
            out.append((torch.randn(batch, 12, generator=generator),
                        torch.randint(0, 5, (batch,), generator=generator)))
        elif kind == "transformer":
            ids = torch.randint(1, 11, (batch, 7), generator=generator)
            ids[:, -2:] = 0  # padding
            out.append((ids, torch.randint(0, 11, (batch, 7), generator=generator)))
        else:
            out.append((torch.randn(batch, 1, 6, 6, generator=generator),
                        torch.randint(0, 3, (batch,), generator=generator)))
    return out


MODELS = {
    "mlp": (mlp, nn.CrossEntropyLoss()),
    "transformer": (transformer, sequence_loss),
    "cnn": (cnn, nn.CrossEntropyLoss()),
}


def build(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return MODELS[kind][0]()


def train_reference(model: nn.Module, loss_fn, data, lr: float = 0.1) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for inputs, targets in data:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses



def assert_same_parameters(model: hp.PipelineModel, reference: nn.Module) -> None:
    expected = {f"layers.{name}": p for name, p in reference.named_parameters()}
    own = {f"layers.{i}." for i in model.layers_of_stage(model.stage)}
    assert sorted(name for name, _ in model.named_parameters()) == sorted(
        name for name in expected if any(name.startswith(prefix) for prefix in own))
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def uneven(count: int, stages: int) -> list[int]:
    """A deliberately lopsided balance: the last stage gets everything left over."""
    return [1] * (stages - 1) + [count - stages + 1]




def train_pipeline(model: hp.PipelineModel, data, lr: float = 0.1) -> list[float]:
    """SGD over ``data`` with ``model.train_step``; returns the losses."""
    parameters = list(model.parameters())  # a stage may hold only parameter-free layers (Tanh)
    optimizer = torch.optim.SGD(parameters, lr=lr) if parameters else None
    losses = []
    for inputs, targets in data:
        if optimizer:
            optimizer.zero_grad()
        losses.append(model.train_step(inputs, targets))
        if optimizer:
            optimizer.step()
    return losses


# ------------------------------------------------------------------ one-process references of the asynchronous schedules


def _clone(parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in parameters.items()}


def _replay_stages(layers: nn.Sequential, balance: list[int], factory) -> tuple[list, list, list]:
    """A replay's stages: ``layers`` cut by ``balance``, each with its own optimizer from ``factory`` and its weight
    versions (version 0 kept)."""
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    modules = [nn.Sequential(*[layers[i] for i in range(bounds[s], bounds[s + 1])]) for s in range(len(balance))]
    return (modules, [factory(list(m.parameters())) for m in modules],
            [{0: _clone(dict(m.named_parameters()))} for m in modules])


def _in_time_order(timeline) -> list:
    """A simulated timeline's actions as ``(start, rank, position, action)``, in the order they ran."""
    return sorted((item.start, rank, position, item.action) for rank, items in enumerate(timeline.stages)
                  for position, item in enumerate(items))


def _replay_forward(modules: list[nn.Module], version: dict[str, torch.Tensor], micro_batch_data: list[tuple], loss_fn,
                    weight: float, flight: dict, s: int, m: int) -> None:
    """A replay's forward of micro-batch ``m`` on stage ``s`` at the weights ``version`` (the last stage: the weighted
    loss); what the backward needs goes to ``flight[(s, m)]``."""
    weights = {k: v.clone().requires_grad_(True) for k, v in version.items()}
    x = micro_batch_data[m][0] if s == 0 else flight[(s - 1, m)][1].detach().requires_grad_(True)
    y = torch.func.functional_call(modules[s], weights, (x,))
    if s == len(modules) - 1:
        y = loss_fn(y, micro_batch_data[m][1]) * weight
    flight[(s, m)] = (x, y, weights)


def _replay_backward(modules: list[nn.Module], flight: dict, s: int, m: int) -> None:
    """A replay's backward of micro-batch ``m`` on stage ``s``: at the weights its forward used, added to the live
    parameters' ``.grad``."""
    x, y, weights = flight[(s, m)]
    if s == len(modules) - 1:
        y.backward()
    else:
        y.backward(flight[(s + 1, m)][0].grad)
    for pname, parameter in modules[s].named_parameters():
        grad = weights[pname].grad
        parameter.grad = grad.clone() if parameter.grad is None else parameter.grad + grad


def replay_asynchronous(name: str, layers: nn.Sequential, balance: list[int], micro_batch_data: list[tuple],
                        loss_fn, factory, vertical_sync: bool = False, micro_batches: int = 1) -> tuple[list, list]:
    """Replays an asynchronous schedule ("pipedream" or "2bw") in one process, from the schedule's data.

    ``micro_batch_data`` is the list of (input, target) micro-batches in admission order (``M`` per
    train_step; then a flush). Each stage is a slice of ``layers`` with its own optimizer from
    ``factory``; every version of its weights is kept. A forward on stage ``s`` uses the version the
    policy names (pipedream: the stage's current one, or with vertical sync the one stage 0 used;
    2bw: that of mini-batch ``t - 1``), its backward differentiates at that version, and a ``U``
    steps the optimizer on the gradients accumulated since the last one.

    Returns:
        (per stage: its live nn.Module slice after the run; per stage: (m, version) of every forward)
    """
    from hybridpipe.pipeline import schedule as sched

    stages = len(balance)
    modules, optimizers, versions = _replay_stages(layers, balance, factory)
    count = [0] * stages
    steps = len(micro_batch_data) // micro_batches
    plan = sched.async_schedule(name, stages, micro_batches, steps=steps, flush=True)
    timeline = sched.simulate(plan)
    events = _in_time_order(timeline)
    flight: dict[tuple[int, int], tuple] = {}
    used: list[list[tuple[int, int]]] = [[] for _ in range(stages)]
    first_stage_version: dict[int, int] = {}
    weight = 1.0 if name == "pipedream" else 1.0 / micro_batches
    for _, s, _, action in events:
        m = action.micro_batch
        if action.kind is sched.ActionKind.FORWARD:
            if name == "2bw":
                version = max(m // micro_batches - 1, 0)
            elif vertical_sync and s > 0:
                version = first_stage_version[m]
            else:
                version = count[s]
            if s == 0:
                first_stage_version[m] = version
            used[s].append((m, version))
            _replay_forward(modules, versions[s][version], micro_batch_data, loss_fn, weight, flight, s, m)
        elif action.kind is sched.ActionKind.BACKWARD:
            _replay_backward(modules, flight, s, m)
        else:  # UPDATE
            optimizers[s].step()
            optimizers[s].zero_grad(set_to_none=True)
            count[s] += 1
            versions[s][count[s]] = _clone(dict(modules[s].named_parameters()))
    return modules, used


def two_bw_reference(model: nn.Module, batches_: list[tuple], loss_fn, factory) -> nn.Module:
    """PipeDream-2BW's update rule in one process: batch t's gradient is taken at W(t-1)
    (W(-1) = W(0)) and applied by the optimizer to W(t)."""
    optimizer = factory(list(model.parameters()))
    previous = _clone(dict(model.named_parameters()))
    for inputs, targets in batches_:
        weights = {k: v.clone().requires_grad_(True) for k, v in previous.items()}
        loss = loss_fn(torch.func.functional_call(model, weights, (inputs,)), targets)
        loss.backward()
        previous = _clone(dict(model.named_parameters()))
        for pname, parameter in model.named_parameters():
            parameter.grad = weights[pname].grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def replay_pipedream_replicas(layers: nn.Sequential, balance: list[int], counts: list[int], micro_batch_data: list[tuple],
                              loss_fn, factory, micro_batches: int) -> list[nn.Module]:
    """PipeDream on stages with their own replica counts, replayed in one process from the schedule's data.

    Replica r of stage s runs micro-batches m ≡ r (mod R_s) (``schedule.replica_streams``, M per train_step, then a
    flush). A stage's replicas hold the same weights: round k of stage s (its micro-batches kR_s .. kR_s + R_s − 1,
    one per replica) is one update, with the mean of the round's gradients, each taken at the weight version its
    forward used; a forward uses the stage's version at that point of the timeline (the replicas' lists simulated
    with each round's updates as one collective).

    Returns:
        per stage: its live nn.Module slice after the run.
    """
    from hybridpipe.pipeline import schedule as sched
    from hybridpipe.runtime import layout, rank_of_place

    stages = len(balance)
    modules, optimizers, versions = _replay_stages(layers, balance, factory)
    count = [0] * stages
    places = layout(tuple(counts))
    where = rank_of_place(tuple(counts))
    streams = sched.replica_streams("pipedream", counts, micro_batches)
    lists: dict[tuple[int, int], list] = {place: [] for place in places}
    for step in range(len(micro_batch_data) // micro_batches):
        for place in places:
            lists[place] += streams[place].segment((step + 1) * micro_batches)
    for place in places:
        lists[place] += streams[place].drain()
    timeline = sched.simulate([lists[place] for place in places],
                              placement=lambda s, m: where[(s, m % counts[s])],
                              together=lambda rank, a: ((a.stage, a.micro_batch // counts[a.stage]), counts[a.stage])
                              if a.kind is sched.ActionKind.UPDATE else None)
    assert all(blocked is None for blocked in timeline.blocked)
    events = _in_time_order(timeline)
    flight: dict[tuple[int, int], tuple] = {}
    stepped: set[tuple[int, int]] = set()
    for _, _, _, action in events:
        s, m = action.stage, action.micro_batch
        if action.kind is sched.ActionKind.FORWARD:
            _replay_forward(modules, versions[s][count[s]], micro_batch_data, loss_fn, 1.0, flight, s, m)
        elif action.kind is sched.ActionKind.BACKWARD:
            _replay_backward(modules, flight, s, m)
        elif (s, m // counts[s]) not in stepped:  # the round's first U: its replicas' gradients, averaged
            stepped.add((s, m // counts[s]))
            for parameter in modules[s].parameters():
                parameter.grad = parameter.grad / counts[s]
            optimizers[s].step()
            optimizers[s].zero_grad(set_to_none=True)
            count[s] += 1
            versions[s][count[s]] = _clone(dict(modules[s].named_parameters()))
    return modules
