"""Benchmark models written here (no torchvision/timm/transformers needed): ResNet-50, ViT-B/16 and
GPT-2-small shapes, resnet18 (overhead-bound at small batches on a GPU), plus the tiny overhead-bound MLP and
the transformer stacks for conversion cost."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Bottleneck(nn.Module):
    def __init__(self, c_in, width, stride):
        super().__init__()
        c_out = width * 4
        self.conv1, self.bn1 = nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class _ResNet(nn.Module):
    """torchvision's ResNet layout: a 7x7 stem and max pooling, four stages of ``block``s (the first of each
    later stage halves the resolution), global average pooling and a linear classifier."""

    def __init__(self, block, depths, expansion, classes, width):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width)
        blocks, c = [], width
        for i, (n, w) in enumerate(zip(depths, (width, 2 * width, 4 * width, 8 * width))):
            for j in range(n):
                blocks.append(block(c, w, 2 if (j == 0 and i > 0) else 1))
                c = w * expansion
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet50(_ResNet):
    """``width`` scales every stage (64 is ResNet-50's); the benchmark's dry run uses 8."""

    def __init__(self, classes=1000, layers=(3, 4, 6, 3), width=64):
        super().__init__(Bottleneck, layers, 4, classes, width)


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(_ResNet):
    """torchvision's resnet18 layout (11.7M parameters at width 64): at batch 8 and 64x64 its kernels are so
    small that launching them, not running them, sets the step time on a GPU."""

    def __init__(self, classes=1000, width=64):
        super().__init__(BasicBlock, (2, 2, 2, 2), 1, classes, width)


class Block(nn.Module):
    def __init__(self, d, heads, causal=False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self, image=64, patch=16, d=768, depth=12, heads=12, classes=1000):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.ln(self.blocks(x))[:, 0])


class GPT2(nn.Module):
    """``init_std=0.02`` initialises embeddings and linears as GPT-2 does (the first loss near log(vocab));
    PyTorch's defaults (None) give the tied unit-variance embedding logits in the hundreds."""

    def __init__(self, vocab=50257, ctx=1024, d=768, depth=12, heads=12, init_std=None):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(d, heads, causal=True) for _ in range(depth)])
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        if init_std is not None:
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, 0.0, init_std)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.lm_head(self.ln(self.blocks(self.wte(ids) + self.wpe(pos))))


class TinyMLP(nn.Module):
    """8 x [Linear 64, LayerNorm, GELU]: kernels cost almost nothing, so the step's own overhead shows."""

    def __init__(self, d=64, depth=8, classes=10):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.GELU()) for _ in range(depth)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.layers(x))


def transformer_stack(depth, d=16, heads=2):
    return nn.Sequential(*[Block(d, heads) for _ in range(depth)])


class ListStack(nn.Module):
    """``depth`` transformer blocks in an ``nn.ModuleList``, as language models hold their decoder layers: the
    blocks ``convert(..., blocks="auto")`` keeps as modules of their own."""

    def __init__(self, depth, d=16, heads=2):
        super().__init__()
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())
