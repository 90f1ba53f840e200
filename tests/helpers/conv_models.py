"""Small convolutional models in training mode for the tests: a ResNet-like stack of
basic blocks with BatchNorm2d (its running statistics and ``num_batches_tracked`` are
buffers the step writes in place). Each factory returns ``(model, example_inputs,
loss_fn)``, the ``--model module:factory`` convention of the command line."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

C = 8  # channels


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, then ReLU (He et al. 2016, torchvision's
    ``resnet.BasicBlock`` without downsampling)."""

    def __init__(self, channels: int = C):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


class TinyResNet(nn.Module):
    """Stem (conv, BN, ReLU, max-pool), ``layers`` basic blocks, average pool, linear head."""

    def __init__(self, layers: int = 3, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.layers = nn.Sequential(*[BasicBlock() for _ in range(layers)])
        self.head = nn.Linear(C, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(self.stem(x))
        return self.head(y.mean((2, 3)))


def tiny_resnet_train(layers: int = 3, batch: int = 4, size: int = 12):
    """A TinyResNet in train mode, one batch of images and its cross-entropy loss."""
    torch.manual_seed(0)
    model = TinyResNet(layers).train()
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 5, (batch,), generator=torch.Generator().manual_seed(2))
    return model, (x,), lambda out: F.cross_entropy(out, target)
