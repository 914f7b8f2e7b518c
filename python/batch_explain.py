"""Explain every prompt of a JSONL file with MACS and write one JSON result per line.

    python python/batch_explain.py python/example_prompts.jsonl results.jsonl --batch-size 4

Each input line holds {"question": ..., "context": ...} (the paper's QA prompt) or {"prompt": ...}, and
optionally an "id". Each output line holds the id, the answer, the prompt and answer tokens, the per-step
z-scores, their mean, and for QA lines the [start, end) token span of the context. Prompts are explained
in left-padded batches; a progress bar counts the prompts.
"""
import argparse
import json
from pathlib import Path

from tqdm import tqdm

import macs_kernels
from macs_kernels.evaluation.alignment import align_qa
from macs_kernels.prompts import qa_messages


def read_jsonl(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "prompt" not in record and not ("question" in record and "context" in record):
            raise SystemExit(f"{path}:{number}: needs 'prompt' or 'question' and 'context'")
        record.setdefault("id", number)
        records.append(record)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", type=Path)
    parser.add_argument("outputs", type=Path)
    parser.add_argument("--model", default=None, help="transformers model id or folder (default: the default model)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    records = read_jsonl(args.inputs)
    model, tokenizer = macs_kernels.load_model(args.model)
    with open(args.outputs, "w") as out, tqdm(total=len(records), unit="prompt") as progress:
        for first in range(0, len(records), args.batch_size):
            chunk = records[first:first + args.batch_size]
            prompts = [r["prompt"] if "prompt" in r else qa_messages(r["question"], r["context"]) for r in chunk]
            for record, explanation in zip(chunk, macs_kernels.explain(
                    model, tokenizer, prompts, max_new_tokens=args.max_new_tokens)):
                result = {"id": record["id"]} | explanation.as_dict()
                if "question" in record:
                    alignment = align_qa(tokenizer, record["question"], record["context"])
                    result["source_span"] = list(alignment.context_tokens)
                out.write(json.dumps(result) + "\n")
            progress.update(len(chunk))
    print(f"wrote {len(records)} results to {args.outputs}")


if __name__ == "__main__":
    main()
