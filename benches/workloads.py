"""The benchmark workloads: each returns (callable, args, kwargs, dynamic_shapes).

Shapes cover what production calls: a 2-op function with a keyword-only argument; an MLP
taking *args, keyword-only args, a defaulted kwarg and **kwargs with nested dicts and lists;
a 6-layer transformer encoder (d=256) with a keyword mask; a conv net with batch norm and
~10 MB of weights; a 256-layer tiny MLP (~1000 graph nodes).
"""

import torch
from torch import nn


def two_op(x, *, scale):
    return x * scale + 1.0


class KwargsMLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.hidden = nn.Linear(d, d)
        self.out = nn.Linear(d, 8)

    def forward(self, x, *extra, scale, bias=None, temperature=1.0, **cfg):
        h = torch.relu(self.inp(x + extra[0]))
        h = self.hidden(h * scale)
        if bias is not None:
            h = h + bias
        h = h + cfg["shift"]["a"] * cfg["shift"]["b"][0] - cfg["shift"]["b"][1]
        return {"logits": self.out(h) / temperature, "hidden": h}


class Encoder(nn.Module):
    def __init__(self, d=256, layers=6):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, src, *, mask):
        return self.enc(src, src_key_padding_mask=mask)


class ConvNet(nn.Module):
    """~10 MB of float32 weights."""

    def __init__(self):
        super().__init__()
        chans = [3, 64, 128, 256, 512]
        layers = []
        for a, b in zip(chans, chans[1:]):
            layers += [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(), nn.MaxPool2d(2)]
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1500))

    def forward(self, images):
        return self.body(images)


class DeepMLP(nn.Module):
    """256 residual layers of 4 ops each: ~1000 graph nodes on tiny tensors."""

    def __init__(self, depth=256, d=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.relu(layer(x)) * 0.5
        return x


def build(name):
    torch.manual_seed(0)
    if name == "two_op":
        return two_op, (torch.randn(8),), {"scale": torch.randn(8)}
    if name == "kwargs_mlp":
        args = (torch.randn(4, 32), torch.randn(4, 32))
        kwargs = {
            "scale": torch.randn(32),
            "bias": torch.randn(32),
            "shift": {"a": torch.randn(32), "b": [torch.randn(32), torch.randn(32)]},
        }
        return KwargsMLP().eval(), args, kwargs
    if name == "transformer":
        mask = torch.zeros(2, 32, dtype=torch.bool)
        mask[1, 24:] = True
        return Encoder().eval(), (torch.randn(2, 32, 256),), {"mask": mask}
    if name == "convnet":
        m = ConvNet().eval()
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, nn.BatchNorm2d):
                    mod.running_mean.uniform_(-0.1, 0.1)
                    mod.running_var.uniform_(0.5, 1.5)
        return m, (torch.randn(1, 3, 32, 32),), {}
    if name == "deep_mlp":
        return DeepMLP().eval(), (torch.randn(4, 16),), {}
    if name == "resnet18":  # torchvision, built from config with random weights
        import torchvision

        return torchvision.models.resnet18(num_classes=10).eval(), (torch.randn(1, 3, 64, 64),), {}
    if name == "gpt2":  # transformers, called as its users call it
        import transformers

        cfg = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=4, n_head=4, n_positions=128)
        ids = torch.randint(0, 1000, (1, 32))
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
        return transformers.GPT2LMHeadModel(cfg).eval(), (), kwargs
    if name == "mobilenet_v3_small":
        import torchvision

        return torchvision.models.mobilenet_v3_small(num_classes=10).eval(), (torch.randn(1, 3, 64, 64),), {}
    if name in ("bert", "llama"):
        import transformers

        common = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4)
        if name == "bert":
            model = transformers.BertModel(transformers.BertConfig(intermediate_size=512, **common))
            ids = torch.randint(0, 1000, (1, 32))
            return model.eval(), (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        cfg = transformers.LlamaConfig(
            intermediate_size=256, num_key_value_heads=2, max_position_embeddings=128, **common
        )
        ids = torch.randint(0, 1000, (1, 32))
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
        return transformers.LlamaForCausalLM(cfg).eval(), (), kwargs
    if name == "vit":
        import transformers

        cfg = transformers.ViTConfig(
            image_size=64,
            patch_size=8,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=512,
            num_labels=10,
        )
        return transformers.ViTForImageClassification(cfg).eval(), (), {"pixel_values": torch.randn(1, 3, 64, 64)}
    raise KeyError(name)


NAMES = ["two_op", "kwargs_mlp", "transformer", "convnet", "deep_mlp"]
# Real models no one here wrote, built from config with random weights and called as their
# users call them (the zoo of tests/test_zoo.py, at benchmark sizes).
ZOO = ["resnet18", "mobilenet_v3_small", "gpt2", "bert", "llama", "vit"]
# Modules a serving process of each workload imports before it loads the model (torch.export
# can't load a ModelOutput it hasn't seen registered; kwexport can): the
# fresh-process timings import them before the clock starts, for every runtime alike.
# torch.export.load needs the output class registered.
PREIMPORT = {name: "transformers.modeling_outputs" for name in ("gpt2", "bert", "llama", "vit")}
