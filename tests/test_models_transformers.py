"""Hugging Face transformers models, tiny configurations with random weights, trained with
an unmodified model against the brute-force oracle. Skipped without transformers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models_common import adam_steps, check_model, class_loss, run_recipe, token_mean_loss  # noqa: E402

VOCAB, T = 40, 5


def _ids(n, seed=0):
    return torch.randint(0, VOCAB, (n, T), generator=torch.Generator().manual_seed(seed))


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


def gemma():
    # GemmaRMSNorm: x_hat * (1 + w); a scaled word embedding (an nn.Embedding subclass), tied
    config = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      max_position_embeddings=16)
    return transformers.GemmaForCausalLM(config)


def _logits(model, ids):
    return model(input_ids=ids).logits


@pytest.mark.parametrize("n", [1, 3])
def test_gpt2_with_tied_embeddings_matches_oracle(n):
    # Conv1D look-alikes, position ids [1, T] broadcast over the batch, wte tied to lm_head
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = _ids(n)
    check_model(gpt2, (ids,), ids, _logits, token_mean_loss)


@pytest.mark.parametrize("n", [1, 3])
def test_bert_classifier_matches_oracle(n):
    ids = _ids(n, 1)
    labels = torch.arange(n) % 3
    check_model(bert, (ids,), labels, _logits, class_loss)


@pytest.mark.parametrize("n", [1, 3])
def test_llama_matches_oracle(n):
    # LlamaRMSNorm: a hand-written RMS norm whose weight is a bare parameter
    ids = _ids(n, 2)
    check_model(llama, (ids,), ids, _logits, token_mean_loss)


def test_gemma_matches_oracle():
    ids = _ids(3, 4)
    check_model(gemma, (ids,), ids, _logits, token_mean_loss)


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_dpadam_trains_unmodified_model(make):
    torch.manual_seed(0)
    ids = _ids(4, 3)
    adam_steps(make(), ((ids,), ids), _logits, token_mean_loss)


def test_recipe_runs():
    namespace = run_recipe("transformers")
    assert namespace["optimizer"].steps_taken == len(namespace["loader"])
