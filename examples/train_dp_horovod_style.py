"""Data-parallel training written the Horovod way: only the import line differs from a Horovod script.

Trains an MLP (default) or a small CNN on scikit-learn's bundled 8x8 digits (1797 images, no
download): a fixed stratified split holds out 297 images for testing, the other 1500 train.
Every rank holds a full model replica, reads its own shard of each epoch (DistributedSampler),
and DistributedOptimizer averages the gradients over all ranks at ``step()``, so each step
trains on a global batch of ``--batch-size * size`` images.

Run (2 ranks; add --allow-run-as-root as root, --oversubscribe above the core count):

    mpirun -n 2 python examples/train_dp_horovod_style.py --epochs 5
    mpirun -n 2 python examples/train_dp_horovod_style.py --model cnn --save /tmp/digits_cnn.pt

The learning rate is scaled by the number of ranks (Horovod's idiom: the global batch grows with
the rank count). So ``-n 1 --batch-size 64 --lr 0.1`` and ``-n 2 --batch-size 32 --lr 0.05``
take the same steps on the same global batches and end with the same weights (up to float
rounding): the per-epoch permutation of DistributedSampler depends only on the seed and the
epoch, and rank r takes positions r, r+size, ..., so the b-sample batches of the ranks together
are exactly the 2b-sample batch of the single rank.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import hybridpipe as hvd

TEST_SIZE = 297  # of the 1797 images; 1500 train (divisible by 1..6 ranks: no sampler padding)
SPLIT_SEED = 0  # the split is fixed, whatever --seed is


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """(train, test): the digits as (N, 1, 8, 8) float32 images in [0, 1] with int64 labels.

    The test set is a fixed stratified sample of 297 images (about 30 of each digit).
    """
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(range(len(labels)), test_size=TEST_SIZE, random_state=SPLIT_SEED,
                                           stratify=digits.target)
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[test_idx], labels[test_idx]))


def build_model(kind: str) -> nn.Module:
    """``mlp``: 64-128-64-10 with ReLU; ``cnn``: two 3x3 convolutions, a 2x2 max-pool, two linear layers.

    No dropout or batch norm, so that the replicas stay identical without further communication.
    """
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    raise ValueError(f"unknown model {kind!r} (choose mlp or cnn)")


@torch.no_grad()
def count_correct(model: nn.Module, dataset: TensorDataset, rank: int = 0, size: int = 1) -> tuple[int, int]:
    """(correct, total) over this rank's shard of ``dataset``: items rank, rank+size, ... (no padding)."""
    model.eval()
    images, labels = dataset.tensors
    images, labels = images[rank::size], labels[rank::size]
    correct = (model(images).argmax(dim=1) == labels).sum().item() if len(labels) else 0
    return int(correct), len(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="per rank; the global batch is this times the number of ranks")
    parser.add_argument("--lr", type=float, default=0.05, help="per-rank learning rate, multiplied by size")
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--save", metavar="PATH", help="rank 0 writes the final state_dict here")
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be at least 1")

    hvd.init()  # one pipeline stage: every rank is a data-parallel replica
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    train_set, test_set = load_data()
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)

    # Start every replica from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    hello = (f"rank {hvd.rank()} of {hvd.size()} (local rank {hvd.local_rank()}): {len(sampler)} training "
             f"images per epoch, {len(loader)} steps of {args.batch_size}")
    lines = hvd.allgather_object(hello)
    if hvd.rank() == 0:
        print("\n".join(lines), flush=True)
        print(f"model {args.model}, {sum(p.numel() for p in model.parameters())} parameters, global batch "
              f"{args.batch_size * hvd.size()}, lr {args.lr} x {hvd.size()} ranks", flush=True)

    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        loss_sum, seen = 0.0, 0
        for images, labels in tqdm(loader, desc=f"epoch {epoch}", disable=hvd.rank() != 0, leave=False):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()  # averages the gradients over the ranks, then the SGD update
            loss_sum += loss.item() * len(labels)
            seen += len(labels)
        # Every rank reads the same number of images, so the average of the per-rank means is the global mean.
        train_loss = hvd.allreduce(torch.tensor(loss_sum / seen), op=hvd.Average).item()
        correct, total = count_correct(model, test_set, hvd.rank(), hvd.size())
        correct = int(hvd.allreduce(torch.tensor(correct), op=hvd.Sum).item())
        total = int(hvd.allreduce(torch.tensor(total), op=hvd.Sum).item())
        accuracy = correct / total
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, "
                  f"test accuracy {accuracy:.4f} ({correct}/{total})", flush=True)

    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.4f} ({correct}/{total})", flush=True)
        if args.save:
            torch.save(model.state_dict(), args.save)
            print(f"saved the state_dict to {args.save}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
