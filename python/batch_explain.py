"""Explain every prompt of a JSONL file with MACS and write one JSON result per line.

    python python/batch_explain.py python/example_prompts.jsonl results.jsonl --batch-size 4
    torchrun --nproc-per-node 2 python/batch_explain.py prompts.jsonl results.jsonl    # data parallel

Each input line holds {"question": ..., "context": ...} (the paper's QA prompt) or {"prompt": ...}, and
optionally an "id". Each output line holds the id, the answer, the prompt and answer tokens, the per-step
z-scores, their mean, and for QA lines the [start, end) token span of the context. Prompts are explained
in left-padded batches; a progress bar counts the prompts.

Results are appended, so a run that stopped (or one of whose torchrun ranks died) resumes: ids already in the
output are skipped. Under torchrun, rank r explains every K-th remaining prompt and all ranks append to the
same output file (whole lines under a lock).
"""
import argparse
import json
from pathlib import Path

from tqdm import tqdm

import macs_kernels
from macs_kernels import qa_messages
from macs_kernels.apps.data_parallel import append_line, data_parallel, end_with_newline
from macs_kernels.apps.evaluation.alignment import align_qa


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
    ids = [r["id"] for r in records]
    if len(set(map(str, ids))) != len(ids):
        raise SystemExit(f"{path}: ids must be unique (results are matched to prompts by id when resuming)")
    return records


def done_ids(path: Path) -> set[str]:
    """Ids already in the output (a line cut short by a killed write is ignored)."""
    done = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", type=Path)
    parser.add_argument("outputs", type=Path)
    parser.add_argument("--model", default=None, help="transformers model id or folder (default: the default model)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    with data_parallel() as shard:
        if shard.leader:
            end_with_newline(args.outputs)
        shard.barrier()
        done = done_ids(args.outputs)
        records = shard.take([r for r in read_jsonl(args.inputs) if str(r["id"]) not in done])
        explain_records(args, records, shard.rank)
        shard.barrier()
    if shard.leader:
        print(f"{args.outputs} holds {len(done_ids(args.outputs))} results ({len(done)} from an earlier run)")


def explain_records(args, records: list[dict], rank: int) -> None:
    model, tokenizer = macs_kernels.load_model(args.model)
    with tqdm(total=len(records), unit="prompt", position=rank) as progress:
        for first in range(0, len(records), args.batch_size):
            chunk = records[first:first + args.batch_size]
            prompts = [r["prompt"] if "prompt" in r else qa_messages(r["question"], r["context"]) for r in chunk]
            for record, explanation in zip(chunk, macs_kernels.explain(
                    model, tokenizer, prompts, max_new_tokens=args.max_new_tokens)):
                result = {"id": record["id"]} | explanation.as_dict()
                if "question" in record:
                    alignment = align_qa(tokenizer, record["question"], record["context"])
                    result["source_span"] = list(alignment.context_tokens)
                append_line(args.outputs, json.dumps(result))
            progress.update(len(chunk))


if __name__ == "__main__":
    main()
