"""Models built from torch.nn alone, as users build them: nn.Transformer encoder-decoder
(batch_first) and a small vision transformer with bare parameters, against the oracle."""

import pytest
import torch
from torch import nn

from models_common import check_model, class_loss

D, T = 8, 4


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.src = nn.Embedding(11, D)
        self.tgt = nn.Embedding(11, D)
        self.pos = nn.Parameter(torch.randn(1, T, D) * 0.1)  # learned positions, bare
        self.core = nn.Transformer(D, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                                   dropout=0.0, batch_first=True)
        self.out = nn.Linear(D, 11)

    def forward(self, src, tgt):
        mask = self.core.generate_square_subsequent_mask(tgt.shape[1], dtype=self.pos.dtype)
        h = self.core(self.src(src) + self.pos, self.tgt(tgt) + self.pos[:, : tgt.shape[1]], tgt_mask=mask)
        return self.out(h).mean(1)


class TinyViT(nn.Module):
    """cls token, position embedding and a learned temperature: all bare parameters."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, D) * 0.1)
        self.temperature = nn.Parameter(torch.tensor(0.5))
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1) + self.pos_embed
        return self.head(self.encoder(h)[:, 0]) / self.temperature.exp()


@pytest.mark.parametrize("n", [1, 3])
def test_nn_transformer_encoder_decoder_matches_oracle(n):
    g = torch.Generator().manual_seed(n)
    src, tgt = torch.randint(0, 11, (n, T), generator=g), torch.randint(0, 11, (n, T), generator=g)
    check_model(Seq2Seq, (src, tgt), torch.arange(n) % 11, lambda m, s, t: m(s, t), class_loss)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_vision_transformer_with_bare_parameters_matches_oracle(n):
    x = torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    check_model(TinyViT, (x,), torch.arange(n) % 3, lambda m, x: m(x), class_loss)
