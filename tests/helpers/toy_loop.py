"""A two-layer regression model and its data for the shared training loop's tests: `setup_loop`
builds the model, AdamW groups, the two-group LR schedule and resumable batches."""

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import SequentialSampler

from predictor_training.data.batches import ResumableBatches
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.optim import TwoGroupLRSchedule, build_optimizer


SINGLE = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
META = {"variant": "toy", "source_blocks": [0, 1], "precision": "fp32master"}


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fusion = nn.Linear(3, 4)
        self.blocks = nn.Linear(4, 1)

    def forward(self, x):
        return self.blocks(torch.tanh(self.fusion(x)))


class RegressionData(torch.utils.data.Dataset):
    def __init__(self, size=8):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 3, generator=generator), torch.randn(size, 1, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def setup_loop(tmp_path, max_steps, batch_size=2):
    torch.manual_seed(0)
    model = TwoLayer()
    optimizer = build_optimizer({"fusion": list(model.fusion.parameters()), "blocks": list(model.blocks.parameters())},
                                {"fusion": 1e-2, "blocks": 1e-2}, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = TwoGroupLRSchedule(optimizer, warmup_steps=0, max_steps=max_steps, block_warmup_steps=None)
    data = RegressionData()
    batches = ResumableBatches(SequentialSampler(data), data, torch.utils.data.default_collate, batch_size=batch_size)
    return model, optimizer, schedule, data, batches
