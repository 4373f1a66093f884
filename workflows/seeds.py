"""The seeds of training's randomness, derived from (train.seed, epoch, rank or sample): the data
order, the dropout RNG, augmentation. Randomness follows the sample, not the rank: a resume on
another worker count, or a Tune trial, draws the same crops (the training loop, workflows.train.loop,
and the image loader's transform, workflows.preprocess.images.ImageTransform, both use them)."""

from __future__ import annotations

import hashlib


def derived_seed(kind: str, seed: int, epoch: int, rank: int = 0) -> int:
    """A 31-bit seed from (kind, seed, epoch, rank): (seed=0, epoch=1) and (seed=1, epoch=0) differ."""
    return int.from_bytes(hashlib.sha256(f"{kind}:{seed}:{epoch}:{rank}".encode()).digest()[:4], "big") >> 1


def data_seed(seed: int, epoch: int, rank: int = 0) -> int:
    """The seed of the data order of one epoch on one rank."""
    return derived_seed("data", seed, epoch, rank)


def augment_seed(seed: int, epoch: int) -> int:
    """The seed a task's training collate draws augmentation from in one epoch (per sample inside
    it): never the rank's, so a resume on another worker count, or a Tune trial, sees the same crops."""
    return derived_seed("augment", seed, epoch)


def dropout_seed(seed: int, epoch: int, rank: int = 0) -> int:
    return derived_seed("dropout", seed, epoch, rank)
