"""Explain a QA answer with MACS and write the self-contained HTML page.

    python python/explain_qa.py                                   # the built-in example
    python python/explain_qa.py --question "..." --context "..." --html answer.html

Uses the default model (SmolLM2-135M-Instruct, CPU) unless --model names another.
"""
import argparse
from pathlib import Path

import macs_kernels
from macs_kernels import qa_messages
from macs_kernels.apps.evaluation.alignment import align_qa

QUESTION = "In which city was the author of the Principia born?"
CONTEXT = (
    "Isaac Newton published the Principia in 1687. He was born in Woolsthorpe, a hamlet in Lincolnshire, "
    "England. He later studied at Trinity College, Cambridge, and died in London in 1727."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--context", default=CONTEXT)
    parser.add_argument("--model", default=None, help="transformers model id or folder (default: the default model)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--html", type=Path, default=Path("macs_explanation.html"))
    args = parser.parse_args()

    model, tokenizer = macs_kernels.load_model(args.model)
    explanation = macs_kernels.explain(model, tokenizer, qa_messages(args.question, args.context),
                                       max_new_tokens=args.max_new_tokens)
    # Score the context only, as the paper does: the source span is where the context's tokens sit.
    alignment = align_qa(tokenizer, args.question, args.context)
    if alignment.input_ids != explanation.input_ids.tolist():
        raise SystemExit("the aligned prompt differs from the explained one; the chat template is not stable")
    explanation.source_span = alignment.context_tokens

    print(f"answer: {explanation.text!r}")
    print("context tokens the answer rests on most (z-score of log consistency over all steps):")
    for _, token, score in explanation.top_k(5, span=True):
        print(f"  {token!r:>16}  z = {score:+.2f}")
    args.html.write_text(explanation.to_html(title=f"MACS: {args.question}"))
    print(f"wrote {args.html}")


if __name__ == "__main__":
    main()
