"""LoRA adapters from peft on tiny transformers models (the usual DP fine-tuning setup):
only the adapters (and peft's saved modules) train; exact against the oracle. Skipped
without peft or transformers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from models_common import adam_steps, check_model, class_loss, run_recipe, token_mean_loss  # noqa: E402

VOCAB, T = 40, 5


def _with_nonzero_b(model):
    # peft starts lora_B at zero, which makes lora_A's gradient exactly zero
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    return model


def lora_llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return _with_nonzero_b(peft.get_peft_model(transformers.LlamaForCausalLM(config).double(), lora))


def lora_bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["query", "value"], lora_dropout=0.0)
    return _with_nonzero_b(peft.get_peft_model(transformers.BertForSequenceClassification(config).double(), lora))


def _ids(n, seed=0):
    return torch.randint(0, VOCAB, (n, T), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    return model(input_ids=ids).logits


def test_only_adapters_train():
    trainable = [n for n, p in lora_llama().named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("n", [1, 3])
def test_lora_llama_matches_oracle(n):
    ids = _ids(n)
    check_model(lora_llama, (ids,), ids, _logits, token_mean_loss)


@pytest.mark.parametrize("n", [1, 3])
def test_lora_bert_classifier_matches_oracle(n):
    ids = _ids(n, 1)
    check_model(lora_bert, (ids,), torch.arange(n) % 3, _logits, class_loss)


def test_dpadam_trains_lora_model():
    torch.manual_seed(0)
    ids = _ids(4, 2)
    adam_steps(lora_bert(), ((ids,), torch.arange(4) % 3), _logits, class_loss)


def test_recipe_runs():
    namespace = run_recipe("peft")
    names = [n for n, _ in namespace["trainable"]]
    assert names and all("lora_" in n or "classifier" in n for n in names)
    assert namespace["optimizer"].steps_taken == 1
