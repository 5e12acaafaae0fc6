"""Fine-tune a benchmark checkpoint, briefly, into a model that answers the bench schemas.

No real checkpoint can be downloaded where the benchmarks run, and a random-weight model
ignores every grammar (nearly each unmasked token is refused), which is not how the
instruction-tuned models people serve behave on JSON. This trains the checkpoint for a few
hundred steps on valid instances of bench/schemas/ (the prompt names the schema, as
`gramserve bench --schema-prompts` does) until greedy decoding without any grammar mostly
gives schema-valid JSON. Instances come from a small generator of the keywords those schemas
use, checked with jsonschema; the tokens are the tokenizer's own encoding of the compact text.

    PYTHONPATH=$PWD python bench/train_json.py MODEL_DIR [--steps 300]   (a GPU: ~1 min)
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.loadgen import load_schemas, schema_prompt  # noqa: E402


def instance(schema: dict, rng: random.Random):
    """A random instance of `schema` (the keywords of bench/schemas/ only)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        return {k: instance(v, rng) for k, v in schema["properties"].items()}
    if kind == "array":
        n = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 5))
        return [instance(schema["items"], rng) for _ in range(n)]
    if kind == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 1000))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        low, high = schema.get("minLength", 0), min(schema.get("maxLength", 12), 12)
        n = rng.randint(low, max(low, high))
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
    raise ValueError(f"no generator for {schema}")


def examples(families: list[str], n: int, seed: int = 0) -> list[tuple[str, str, dict]]:
    """n (prompt, compact JSON text, schema) triples, cycling the families' schemas."""
    import jsonschema

    rng = random.Random(seed)
    schemas = [s for f in families for s in load_schemas(f)]
    out = []
    for i in range(n):
        text = schemas[i % len(schemas)]
        schema = json.loads(text)
        value = instance(schema, rng)
        jsonschema.validate(value, schema)
        out.append((schema_prompt(text), json.dumps(value, separators=(",", ":")), schema))
    return out


def valid_rate(hf, tokenizer, families: list[str], device, max_new: int = 160) -> float:
    """Share of schema-valid answers under greedy decoding without a grammar, one prompt per
    schema of `families`."""
    import jsonschema
    import torch

    schemas = [s for f in families for s in load_schemas(f)]
    eos = tokenizer.eos_token_id
    prompts = [tokenizer.encode(schema_prompt(text)) for text in schemas]
    width = max(map(len, prompts))  # left-padded: one batch
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        seq = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)
    ok = 0
    for text, row in zip(schemas, seq[:, width:], strict=True):
        answer = tokenizer.decode(row, skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(answer), json.loads(text))
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok / len(schemas)


def train(model_dir: Path, families: list[str], steps: int = 300, batch: int = 32,
          lr: float = 3e-4, target: float = 0.9, log=print) -> dict:
    """Fine-tune `model_dir` in place (bf16 on the GPU) until `target` of greedy answers are
    schema-valid, or `steps`; returns what it measured."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device)
    eos = tokenizer.eos_token_id
    data = examples(families, steps * batch)
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)
    t0 = time.perf_counter()
    report = {"steps": 0, "valid_before": valid_rate(hf.eval(), tokenizer, families, device)}
    log(f"train: greedy schema-valid before training {report['valid_before']:.2f}")
    for step in range(steps):
        hf.train()
        rows = data[step * batch:(step + 1) * batch]
        seqs, labels = [], []
        for prompt, answer, _ in rows:
            p = tokenizer.encode(prompt)
            a = tokenizer.encode(answer) + [eos]
            seqs.append(p + a)
            labels.append([-100] * len(p) + a)  # learn the answer only
        width = max(map(len, seqs))
        ids = torch.tensor([s + [eos] * (width - len(s)) for s in seqs], device=device)
        lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        loss = hf(input_ids=ids, attention_mask=mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        report["steps"] = step + 1
        if (step + 1) % 50 == 0 or step + 1 == steps:
            rate = valid_rate(hf.eval(), tokenizer, families, device)
            report.update(loss=float(loss), valid=rate)
            log(f"train: step {step + 1} loss {float(loss):.3f} greedy schema-valid {rate:.2f} "
                f"({time.perf_counter() - t0:.0f} s)")
            if rate >= target:
                break
    report["seconds"] = time.perf_counter() - t0
    hf.eval().save_pretrained(model_dir, safe_serialization=True)
    del hf, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--families", default="short,long")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    ns = p.parse_args()
    print(train(ns.model_dir, ns.families.split(","), ns.steps, ns.batch))


if __name__ == "__main__":
    main()
