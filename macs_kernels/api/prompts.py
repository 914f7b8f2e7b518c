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


# A base model has no chat template: its prompt is the messages' text, and a generation starts after this cue.
PLAIN_GENERATION_CUE = "\nAnswer:"


def plain_prompt(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Chat messages as the plain text prompt of a model without a chat template (a pretrained base model):
    their contents one after another, then PLAIN_GENERATION_CUE when a generation follows."""
    text = "\n\n".join(str(m.get("content", "")) for m in messages)
    return text + (PLAIN_GENERATION_CUE if add_generation_prompt else "")


def is_messages(value) -> bool:
    """Whether a prompt is one chat (a non-empty list of message dicts) rather than a string or a batch."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)
