"""Synthetic token sequences for the sequence examples (lstm_text.py, transformer.py).

Each sequence (8 to 32 tokens, padded with 0) is filler text with three keywords of its
class at random positions; a model must find them. Token 0 is padding, tokens
``1 .. CLASSES * KEYWORDS_PER_CLASS`` are the keywords, the rest filler.
"""

import torch

VOCAB, CLASSES, KEYWORDS_PER_CLASS, MAX_LEN = 200, 4, 5, 32


def keyword_sequences(n: int, generator: torch.Generator):
    """``n`` sequences: (tokens [n, MAX_LEN] padded with 0, lengths [n], labels [n])."""
    labels = torch.randint(CLASSES, (n,), generator=generator)
    lengths = torch.randint(8, MAX_LEN + 1, (n,), generator=generator)
    first_filler = 1 + CLASSES * KEYWORDS_PER_CLASS
    tokens = torch.randint(first_filler, VOCAB, (n, MAX_LEN), generator=generator)
    for i in range(n):
        positions = torch.randperm(int(lengths[i]), generator=generator)[:3]
        keywords = torch.randint(KEYWORDS_PER_CLASS, (3,), generator=generator)
        tokens[i, positions] = 1 + int(labels[i]) * KEYWORDS_PER_CLASS + keywords
    tokens[torch.arange(MAX_LEN) >= lengths[:, None]] = 0
    return tokens, lengths, labels
