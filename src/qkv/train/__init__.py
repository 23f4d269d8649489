"""Training: one loop for every family and task (Trainer), its config, schedules, checkpoints,
stability guards, mixed precision and DDP/FSDP2 data parallelism."""

from qkv.train.batches import LengthTruncationWarning, truncate_batch
from qkv.train.callbacks import Callback, LambdaCallback, StopAt
from qkv.train.checkpoint import latest_checkpoint, list_checkpoints, read_checkpoint
from qkv.train.config import TrainConfig
from qkv.train.optim import build_optimizer, param_groups
from qkv.train.rng import seed_everything
from qkv.train.schedule import lr_at, noam
from qkv.train.stability import NonFiniteError
from qkv.train.trainer import Trainer, TrainingInterrupted

__all__ = [
    "Callback", "LambdaCallback", "LengthTruncationWarning", "NonFiniteError", "StopAt", "TrainConfig",
    "Trainer", "TrainingInterrupted",
    "build_optimizer", "latest_checkpoint", "list_checkpoints", "lr_at", "noam", "param_groups",
    "read_checkpoint", "seed_everything", "truncate_batch",
]
