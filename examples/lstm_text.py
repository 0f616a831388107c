"""An Embedding + LSTM text classifier trained with DP-Adam on synthetic token sequences.

Each sequence (8 to 32 tokens, padded with 0) is filler text with a few keywords of its
class sprinkled in (keyword_data.py); the model must find them. It shows that recurrent
models need no special layer: a plain ``nn.LSTM`` fed a ``PackedSequence``, and an
``nn.Embedding`` with ``padding_idx`` (whose padding row gets no gradient, per example as
in the whole batch).

    python examples/lstm_text.py            # about 93% test accuracy at epsilon 4, under a minute
    python examples/lstm_text.py --quick    # a few seconds: a smoke test
"""

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import TensorDataset

import dpoptim
from dpoptim.data import poisson_loader, privacy_kwargs
from keyword_data import CLASSES, VOCAB, keyword_sequences  # this folder's data module

class LSTMClassifier(nn.Module):
    def __init__(self, embed: int = 32, hidden: int = 64):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, embed, padding_idx=0)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embedding(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (h_n, _) = self.lstm(packed)
        return self.head(h_n[-1])  # the hidden state after each sequence's last real token


@torch.no_grad()
def accuracy(model, tokens, lengths, labels) -> float:
    return (model(tokens, lengths).argmax(1) == labels).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small data set and one epoch: a smoke test")
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=200, help="expected batch size")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the initial weights")
    args = parser.parse_args()
    n_train, epochs = (1000, 1) if args.quick else (4000, args.epochs)

    data = torch.Generator().manual_seed(args.seed)
    train_set = TensorDataset(*keyword_sequences(n_train, data))
    test_tokens, test_lengths, test_labels = keyword_sequences(1000, data)

    torch.manual_seed(args.seed)
    model = LSTMClassifier()
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
        for tokens, lengths, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(tokens, lengths), labels).backward()
            optimizer.step()
        epsilon, delta = optimizer.privacy_spent()
        print(f"epoch {epoch}: test accuracy {accuracy(model, test_tokens, test_lengths, test_labels):6.1%} "
              f"(chance {1 / CLASSES:.0%}), epsilon {epsilon:.2f} (delta = {delta:g})")
    print(f"{optimizer.steps_taken} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
