"""Step time on real models from their libraries (random weights, small configurations):
DPSGD and Opacus against non-private SGD, batch 8, CPU.

Models: Hugging Face GPT-2 (tied embeddings), BERT (sequence classification), Llama; LoRA
from peft on Llama (q, v) and BERT; torch's nn.Transformer (encoder-decoder, batch_first);
timm's ViT and ConvNeXt; torchvision's ResNet-18 with GroupNorm. Each library is optional:
the models of a missing one are skipped, and the rows already in the JSON file (from a run
in another environment) are kept, so that runs in two environments fill one table.

For each model, non-private SGD, DPSGD and (where it runs) Opacus' per-sample hooks train
their own copy of the same model on the same batches, in one process, taking turns step by
step; a step is zero_grad, forward, loss, backward, optimizer step. The ratio is the median
over rounds of (mode's step / non-private step of the same round). dpoptim's process-wide
hooks are taken out while the other modes step. Opacus gets the model unmodified, as
dpoptim does (no ModuleValidator.fix); where it refuses or fails, the reason is reported.
A script, not a test::

    python -m benchmarks.bench_models [--rounds 15] [--threads 2] [--write]

``--write`` stores the rows in docs/benchmarks_models.json and renders the section between
the markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import dpoptim

from . import report

BATCH = 8
_DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
JSON_PATH = os.path.join(_DOCS, "benchmarks_models.json")
MD_PATH = os.path.join(_DOCS, "benchmarks.md")
START, END = "<!-- models:start -->", "<!-- models:end -->"


def _has(name):
    return importlib.util.find_spec(name) is not None


# ----------------------------------------------------------------- models and batches
def _tokens(vocab, T):
    def batch(g):
        ids = torch.randint(0, vocab, (BATCH, T), generator=g)
        return (ids,), ids
    return batch


def _lm_loss(out, ids):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _cls_loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits, y)


def _classes(vocab, T, classes):
    def batch(g):
        return (torch.randint(0, vocab, (BATCH, T), generator=g),), torch.randint(0, classes, (BATCH,), generator=g)
    return batch


def _images(size, classes):
    def batch(g):
        return (torch.randn(BATCH, 3, size, size, generator=g),), torch.randint(0, classes, (BATCH,), generator=g)
    return batch


def _hf(kind):
    import transformers

    common = dict(vocab_size=1000, max_position_embeddings=128)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=1000, n_positions=128, n_embd=128, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if kind == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=4, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **common))


def _lora(kind):
    import peft

    if kind == "llama":
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    else:
        config = peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=["query", "value"],
                                 lora_dropout=0.0)
    return peft.get_peft_model(_hf(kind), config)


class _Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.src = nn.Embedding(1000, 128)
        self.tgt = nn.Embedding(1000, 128)
        self.core = nn.Transformer(128, 4, 2, 2, 512, dropout=0.0, batch_first=True)
        self.out = nn.Linear(128, 1000)

    def forward(self, ids):
        return self.out(self.core(self.src(ids), self.tgt(ids)))


def _timm(name):
    import timm

    if name == "vit":
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10)
    return timm.create_model("convnext_atto", pretrained=False, num_classes=10)


def _resnet():
    import torchvision

    return torchvision.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(32, c))


# name -> (library needed, model factory, batch factory, loss, description)
MODELS = {
    "gpt2": ("transformers", lambda: _hf("gpt2"), _tokens(1000, 64), _lm_loss,
             "HF GPT-2, 2 layers, d=128, T=64, tied wte/lm_head"),
    "bert": ("transformers", lambda: _hf("bert"), _classes(1000, 64, 4), _cls_loss,
             "HF BERT classifier, 2 layers, d=128, T=64"),
    "llama": ("transformers", lambda: _hf("llama"), _tokens(1000, 64), _lm_loss,
              "HF Llama, 2 layers, d=128, T=64"),
    "lora-llama": ("peft", lambda: _lora("llama"), _tokens(1000, 64), _lm_loss,
                   "peft LoRA r=8 on Llama (q, v), as above"),
    "lora-bert": ("peft", lambda: _lora("bert"), _classes(1000, 64, 4), _cls_loss,
                  "peft LoRA r=8 on BERT (query, value), as above"),
    "transformer": ("torch", _Seq2Seq, _tokens(1000, 32), _lm_loss,
                    "nn.Transformer 2+2 layers, d=128, T=32, batch_first"),
    "vit": ("timm", lambda: _timm("vit"), _images(32, 10), _cls_loss,
            "timm ViT-Tiny (12 blocks, d=192), 32x32, patch 4"),
    "convnext": ("timm", lambda: _timm("convnext"), _images(64, 10), _cls_loss,
                 "timm ConvNeXt-Atto, 64x64"),
    "resnet18": ("torchvision", _resnet, _images(64, 10), _cls_loss,
                 "torchvision ResNet-18, GroupNorm, 64x64"),
}


# ----------------------------------------------------------------- timing
class _Paused:
    """dpoptim's process-wide forward hooks, out while another mode steps."""

    def __init__(self):
        module = nn.modules.module
        self.dicts = (module._global_forward_pre_hooks, module._global_forward_hooks)
        self.saved = []

    def __enter__(self):
        self.saved = [(d, k, d.pop(k)) for d in self.dicts for k in list(d)]

    def __exit__(self, *exc):
        for d, k, v in self.saved:
            d[k] = v


def _opacus(model):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    wrapped = GradSampleModule(model)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    opt = DPOptimizer(torch.optim.SGD(params, lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=BATCH)
    return wrapped, opt


def measure(name, rounds):
    library, make, batch, loss_fn, _ = MODELS[name]
    torch.manual_seed(0)
    base = make()
    base.train()
    g = torch.Generator().manual_seed(1)
    batches = [batch(g) for _ in range(3)]
    modes = {}
    model = copy.deepcopy(base)
    modes["non-private"] = (model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3), True)
    model = copy.deepcopy(base)
    modes["dpoptim"] = (model, dpoptim.DPSGD([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                                             noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=BATCH,
                                             sample_rate=BATCH / 50_000), False)
    failures = {}
    if _has("opacus"):
        try:
            wrapped, opt = _opacus(copy.deepcopy(base))
            modes["opacus"] = (wrapped, opt, True)
        except Exception as exc:  # noqa: BLE001 (reported, not hidden)
            failures["opacus"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    paused = _Paused()

    def step(mode, i):
        model, opt, pause = modes[mode]
        inputs, target = batches[i % len(batches)]
        start = time.perf_counter()
        if pause:
            paused.__enter__()
        try:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(*inputs), target).backward()
            opt.step()
        finally:
            if pause:
                paused.__exit__()
        return time.perf_counter() - start

    first = {}
    for mode in list(modes):
        try:
            first[mode] = step(mode, 0)
            step(mode, 1)
        except Exception as exc:  # noqa: BLE001
            failures[mode] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            del modes[mode]
    times = {mode: [] for mode in modes}
    for r in range(rounds):
        order = list(modes) if r % 2 else list(reversed(modes))
        for mode in order:
            times[mode].append(step(mode, r))
    result = {"ms": {}, "ratio": {}, "failed": failures, "first_ms": 1e3 * first.get("dpoptim", float("nan"))}
    if "non-private" in times:
        ref = times["non-private"]
        for mode, ts in times.items():
            result["ms"][mode] = 1e3 * statistics.median(ts)
            result["ratio"][mode] = statistics.median(t / b for t, b in zip(ts, ref))
    return result


# ----------------------------------------------------------------- report
def _cell(result, mode):
    if mode in result["failed"]:
        return "fails: " + result["failed"][mode].replace("|", "/")
    if mode not in result["ratio"]:
        return "not run"
    return f"{result['ratio'][mode]:.2f}x ({result['ms'][mode]:.1f} ms)"


def render(rows) -> str:
    lines = [
        START,
        "## Real models (CPU, batch 8)",
        "",
        "Generated by `python -m benchmarks.bench_models --write` (each environment adds the rows of the "
        "libraries it has); do not edit by hand. Models from their own libraries with random weights and "
        "small configurations, unmodified. One step (zero_grad, forward, loss, backward, optimizer step), "
        "batch 8; every mode trains its own copy in one process, taking turns; the ratio is the median "
        "over rounds of (mode's step / non-private SGD step of the same round), lower is better. Opacus "
        "runs its per-sample hooks (`GradSampleModule`, with its functorch fallback) on the same unmodified "
        "model. dpoptim's first step, which also checks every rule against autograd, is shown apart. "
        "The rows were measured on a shared 2-core machine under other load, in the environment "
        "named in the last column (timm and torchvision need a torch build of their own): absolute "
        "times are inflated and differ between rows; the ratios, medians of pairs of steps taken "
        "back to back, are what to compare. Opacus' per-sample gradients are not checked here "
        "(dpoptim's are, by the tests of docs/recipes.md).",
        "",
        "| model | non-private | dpoptim | Opacus 1.6 (hooks) | dpoptim first step | run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in MODELS:
        if name not in rows:
            lines.append(f"| {MODELS[name][4]} | not measured | | | | |")
            continue
        r = rows[name]
        base = f"{r['ms']['non-private']:.1f} ms" if "non-private" in r["ms"] else "—"
        lines.append(f"| {MODELS[name][4]} | {base} | {_cell(r, 'dpoptim')} | {_cell(r, 'opacus')} | "
                     f"{r['first_ms']:.0f} ms | {r['env']} |")
    lines += ["", END]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=sorted(MODELS), action="append")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks_models.json and benchmarks.md")
    parser.add_argument("--render-only", action="store_true", help="rewrite the section from the JSON, measure nothing")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    env = f"torch {torch.__version__}, {args.threads} threads"
    if _has("opacus"):
        import opacus
        env += f", Opacus {opacus.__version__}"
    rows = {}
    if os.path.exists(JSON_PATH):
        with open(JSON_PATH) as f:
            rows = json.load(f)
    for name in [] if args.render_only else args.only or list(MODELS):
        library = MODELS[name][0]
        if library != "torch" and not _has(library):
            print(f"{name:12s} skipped: {library} is not installed")
            continue
        try:
            result = measure(name, args.rounds)
        except Exception as exc:  # noqa: BLE001
            print(f"{name:12s} could not be built: {type(exc).__name__}: {exc}")
            continue
        result["env"] = env
        result["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        rows[name] = result
        print(f"{name:12s} " + "  ".join(f"{m} {_cell(result, m)}" for m in ("non-private", "dpoptim", "opacus")))
    if args.write or args.render_only:
        with open(JSON_PATH, "w") as f:
            json.dump(rows, f, indent=1, sort_keys=True)
        report.write_section(MD_PATH, render(rows))


if __name__ == "__main__":
    main()
