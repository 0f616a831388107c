"""A small ``nn.TransformerEncoder`` classifier trained with DP-Adam on synthetic sequences.

Each sequence (8 to 32 tokens, padded with 0) is filler with a few keywords of its class
sprinkled in (keyword_data.py). The model is stock PyTorch: token and learned position
embeddings (``nn.Embedding``), two ``nn.TransformerEncoderLayer`` blocks with a key
padding mask, a final ``nn.LayerNorm`` and a linear head over the mean of the real tokens.
Every layer has a built-in rule; nothing is replaced, and the layers keep PyTorch's
default dropout of 0.1 (attention dropout included: dpoptim clips exactly with the masks
the forward drew).

    python examples/transformer.py            # about 94% test accuracy at epsilon 4, about a minute
    python examples/transformer.py --quick    # a few seconds: a smoke test
"""

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import dpoptim
from dpoptim.data import poisson_loader, privacy_kwargs
from keyword_data import CLASSES, MAX_LEN, VOCAB, keyword_sequences  # this folder's data module

class TransformerClassifier(nn.Module):
    def __init__(self, d_model: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model, padding_idx=0)
        self.positions = nn.Embedding(MAX_LEN, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, CLASSES)

    def forward(self, tokens):
        padding = tokens == 0
        # Position indices get a batch dimension ([n, T], not [T]): dpoptim takes the first
        # dimension of every layer's input as the examples, so a shared [T] lookup would
        # look like a batch of T examples.
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.tokens(tokens) + self.positions(positions)
        x = self.norm(self.encoder(x, src_key_padding_mask=padding))
        real = (~padding).unsqueeze(-1).to(x.dtype)
        pooled = (x * real).sum(1) / real.sum(1).clamp(min=1)
        return self.head(pooled)


@torch.no_grad()
def accuracy(model, tokens, labels) -> float:
    model.eval()
    correct = (model(tokens).argmax(1) == labels).float().mean().item()
    model.train()
    return correct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small data set and one epoch: a smoke test")
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=200, help="expected batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the initial weights")
    args = parser.parse_args()
    n_train, epochs = (600, 1) if args.quick else (4000, args.epochs)

    data = torch.Generator().manual_seed(args.seed)
    tokens, _, labels = keyword_sequences(n_train, data)
    train_set = TensorDataset(tokens, labels)
    test_tokens, _, test_labels = keyword_sequences(1000, data)

    torch.manual_seed(args.seed)
    model = TransformerClassifier()
    loader = poisson_loader(train_set, sample_rate=args.batch_size / n_train)
    optimizer = dpoptim.DPAdam(
        model.parameters(),
        lr=args.lr,
        max_grad_norm=args.max_grad_norm,
        target_epsilon=args.epsilon,
        steps=epochs * len(loader),
        **privacy_kwargs(loader),
    )
    print(f"{n_train} training sequences, q = {optimizer.sample_rate:.3f}, "
          f"noise multiplier {optimizer.noise_multiplier:.3f} for epsilon {args.epsilon:g}")

    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        for tokens, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(tokens), labels).backward()
            optimizer.step()
        epsilon, delta = optimizer.privacy_spent()
        print(f"epoch {epoch}: test accuracy {accuracy(model, test_tokens, test_labels):6.1%} "
              f"(chance {1 / CLASSES:.0%}), epsilon {epsilon:.2f} (delta = {delta:g})")
    print(f"{optimizer.steps_taken} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
