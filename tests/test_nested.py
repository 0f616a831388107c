"""dpoptim.nested: the one walker over nested batches, arguments and saved values."""

from __future__ import annotations

from collections import OrderedDict, UserDict, defaultdict, namedtuple

import torch
from torch.nn.utils.rnn import pack_sequence

from dpoptim import nested

Pair = namedtuple("Pair", "a b")


class Encoding(UserDict):
    """A Mapping that is not a dict (as transformers' BatchEncoding)."""


def test_map_tensors_keeps_every_container_type():
    obj = {"x": Encoding({"ids": torch.ones(2)}), "p": Pair(torch.zeros(1), "tag"),
           "l": [torch.ones(1), 3, (torch.ones(2),)], "o": OrderedDict(k=torch.ones(1))}
    out = nested.map_tensors(lambda t: t + 1, obj)
    assert type(out["x"]) is Encoding and torch.equal(out["x"]["ids"], torch.full((2,), 2.0))
    assert type(out["p"]) is Pair and out["p"].b == "tag" and torch.equal(out["p"].a, torch.ones(1))
    assert out["l"][1] == 3 and type(out["l"][2]) is tuple and torch.equal(out["l"][2][0], torch.full((2,), 2.0))
    assert type(out["o"]) is OrderedDict
    d = defaultdict(list, {"k": torch.ones(1)})
    assert torch.equal(nested.map_tensors(lambda t: t * 3, d)["k"], torch.full((1,), 3.0))


def test_packed_sequence_is_rebuilt_without_repacking():
    packed = pack_sequence([torch.ones(3, 2, requires_grad=True), torch.ones(1, 2)], enforce_sorted=False)
    out = nested.map_tensors(torch.Tensor.detach, packed)
    assert type(out) is type(packed) and not out.data.requires_grad
    assert torch.equal(out.batch_sizes, packed.batch_sizes) and torch.equal(out.sorted_indices, packed.sorted_indices)


def test_parallel_walk_and_plain_sequences():
    a = {"x": torch.ones(1, 2), "names": ["a"], "n": Pair(torch.ones(1), ["u"])}
    b = {"x": torch.ones(2, 2), "names": ["a", "b"], "n": Pair(torch.ones(2), ["u", "v"])}
    seen = []
    out = nested.map_structure(lambda x, y: (seen.append(type(x)), x)[1], a, b,
                               values=lambda x, y: type(x)(list(x) + list(y)))
    assert out["names"] == ["a", "a", "b"] and out["n"].b == ["u", "u", "v"]
    assert seen.count(torch.Tensor) == 2
    sizes = []
    nested.visit_tensors(lambda t: sizes.append(t.shape[0]), b)
    assert sorted(sizes) == [2, 2]


def test_flatten_round_trip_is_torch_pytree():
    leaves, spec = nested.flatten(((torch.ones(1), 2), {"k": Pair(torch.zeros(1), "s")}))
    assert len(leaves) == 4
    assert nested.unflatten(leaves, spec)[1]["k"].b == "s"
