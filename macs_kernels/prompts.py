"""The MACS paper's QA prompt (Sec. 4.1.1), one user message; the CLI, tests and evaluation all build it here."""
from __future__ import annotations

QA_TEMPLATE = (
    "Answer the question based on the following text. Keep your response short and simple. "
    "Do not quote the original text.\n"
    "Question: {question}\n"
    "Context: {context}"
)


def qa_prompt(question: str, context: str) -> str:
    """The user message text of the paper's QA prompt."""
    if not question.strip():
        raise ValueError("the question is empty")
    if not context.strip():
        raise ValueError("the context is empty")
    return QA_TEMPLATE.format(question=question, context=context)


def qa_messages(question: str, context: str) -> list[dict]:
    """The QA prompt as chat messages (the tokenizer's chat template adds its system message)."""
    return [{"role": "user", "content": qa_prompt(question, context)}]
