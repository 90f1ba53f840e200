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
    """conv-BN-ReLU-conv-BN plus the shortcut, then ReLU (He et al. 2016, torchvision's
    ``resnet.BasicBlock``): the shortcut is the identity, or a strided 1x1 conv and BN
    when the block changes the width or the resolution."""

    def __init__(self, channels: int = C, out: int | None = None, stride: int = 1):
        super().__init__()
        out = out or channels
        self.conv1 = nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = (nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
                           if stride != 1 or out != channels else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(self.bn2(self.conv2(y)) + shortcut)


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


class ResNet18Like(nn.Module):
    """torchvision's ResNet-18 layout at small widths: stem, four stages ``layer1`` ..
    ``layer4`` of two BasicBlocks each (the first of stages 2-4 downsamples), pool, head."""

    def __init__(self, width: int = 4, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        widths = [width, 2 * width, 4 * width, 8 * width]
        for i, w in enumerate(widths):
            prev = widths[max(i - 1, 0)]
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(prev, w, 1 if i == 0 else 2), BasicBlock(w)))
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        for i in range(1, 5):
            y = getattr(self, f"layer{i}")(y)
        return self.fc(y.mean((2, 3)))


def resnet18_like_train(batch: int = 2, size: int = 16):
    """A ResNet18Like in train mode, one batch of images and its cross-entropy loss."""
    torch.manual_seed(0)
    model = ResNet18Like().train()
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 5, (batch,), generator=torch.Generator().manual_seed(2))
    return model, (x,), lambda out: F.cross_entropy(out, target)


class ConvNeXtBlock(nn.Module):
    """torchvision's ``CNBlock`` (Liu et al. 2022, "A ConvNet for the 2020s", Fig. 4):
    7x7 depthwise conv, LayerNorm over channels (channels last), Linear 4x, GELU,
    Linear back, layer scale, residual."""

    def __init__(self, c: int):
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.layer_scale = nn.Parameter(torch.full((c, 1, 1), 1e-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class ConvNeXtLike(nn.Module):
    """torchvision's ConvNeXt layout at small widths: ``features`` is a Sequential of a
    4x4 stride-4 stem, then stages (Sequentials of blocks) with a downsampling layer
    (LayerNorm, 2x2 stride-2 conv) between them; several layer stacks, one per stage."""

    def __init__(self, width: int = 8, depths: tuple[int, ...] = (2, 2, 3), classes: int = 5):
        super().__init__()
        widths = [width * 2**i for i in range(len(depths))]
        layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 4, stride=4)]
        for i, (w, d) in enumerate(zip(widths, depths)):
            if i:
                layers.append(_Downsample(widths[i - 1], w))
            layers.append(nn.Sequential(*(ConvNeXtBlock(w) for _ in range(d))))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class _Downsample(nn.Module):
    """ConvNeXt's LayerNorm2d then a 2x2 stride-2 convolution."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm, self.conv = nn.LayerNorm(c_in, eps=1e-6), nn.Conv2d(c_in, c_out, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def convnext_like(batch: int = 2, size: int = 32):
    """A ConvNeXtLike, one batch of images and its cross-entropy loss."""
    torch.manual_seed(0)
    model = ConvNeXtLike().train()
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 5, (batch,), generator=torch.Generator().manual_seed(2))
    return model, (x,), lambda out: F.cross_entropy(out, target)
