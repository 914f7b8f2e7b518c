import json
from pathlib import Path

import pytest

from macs_kernels.apps.evaluation.data import QASample, load_qa, parse_range
from tests.apps.evaluation import stqa_350

FLAT = [
    {"question": f"Q{i}?", "context": f"Context number {i}.", "answers": [{"text": "number", "answer_start": 8}]}
    for i in range(6)
]
NESTED = {
    "version": "v2.0",
    "data": [
        {"title": "A", "paragraphs": [
            {"context": "Köln liegt am Rhein.", "qas": [
                {"id": "a1", "question": "Wo?", "answers": [{"text": "am Rhein", "answer_start": 11}],
                 "is_impossible": False},
                {"id": "a2", "question": "Wann?", "answers": [], "is_impossible": True,
                 "plausible_answers": [{"text": "Rhein", "answer_start": 14}]},
            ]},
        ]},
        {"title": "B", "paragraphs": [
            {"context": "Paris is big.", "qas": [
                {"id": "b1", "question": "Which?", "answers": [{"text": "Paris", "answer_start": 0},
                                                               {"text": "Paris is", "answer_start": 0}]},
            ]},
        ]},
    ],
}


def _write(tmp_path: Path, name: str, data) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def test_flat_list_range_and_n(tmp_path):
    path = _write(tmp_path, "flat.json", FLAT)
    everything = load_qa(path)
    assert everything[0] == QASample(0, "Q0?", "Context number 0.", (("number", 8),))
    picked = load_qa(path, range=(2, 5), n=2)
    assert [s.index for s in picked] == [2, 3]
    assert [s.index for s in load_qa(path, range=parse_range("4:"))] == [4, 5]
    with pytest.raises(ValueError, match="only 6"):
        load_qa(path, range=(6, 8))


def test_nested_squad_keeps_unanswerable_without_answers(tmp_path):
    samples = load_qa(_write(tmp_path, "nested.json", NESTED))
    assert [(s.id, s.context, s.answers) for s in samples] == [
        ("a1", "Köln liegt am Rhein.", (("am Rhein", 11),)),
        ("a2", "Köln liegt am Rhein.", ()),
        ("b1", "Paris is big.", (("Paris", 0), ("Paris is", 0))),
    ]


def test_datasets_local_json_and_saved_folder(tmp_path):
    import datasets

    via_datasets = load_qa(hf_dataset=str(_write(tmp_path, "flat.json", FLAT)), range=(1, 3),
                           cache_dir=tmp_path / "cache")
    assert via_datasets == load_qa(tmp_path / "flat.json", range=(1, 3))
    # The hub's SQuAD columns: answers as {"text": [...], "answer_start": [...]}.
    hub_like = datasets.Dataset.from_list([
        {"id": "x", "question": "Who?", "context": "Ada wrote it.",
         "answers": {"text": ["Ada", "Ada wrote"], "answer_start": [0, 0]}},
        {"id": "y", "question": "Why?", "context": "No idea.", "answers": {"text": [], "answer_start": []}},
    ])
    datasets.DatasetDict({"validation": hub_like}).save_to_disk(str(tmp_path / "saved"))
    samples = load_qa(hf_dataset=str(tmp_path / "saved"), split="validation")
    assert [(s.id, s.answers) for s in samples] == [("x", (("Ada", 0), ("Ada wrote", 0))), ("y", ())]


def test_bad_input_is_reported(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        load_qa()
    with pytest.raises(ValueError, match="START:STOP"):
        parse_range("250")


def test_answers_at_a_wrong_offset_move_to_the_nearest_occurrence_of_their_text(tmp_path):
    context = "Paris is big. Rome is old. Paris is the capital. Nice is south."
    records = [
        # at 22 the context holds "old." : the nearest "Paris" is the one at 27, not the one at 0
        {"question": "Q0", "context": context, "answers": [{"text": "Paris", "answer_start": 22}]},
        {"question": "Q1", "context": context, "answers": [{"text": "Rome", "answer_start": 14},  # right
                                                            {"text": "Nice", "answer_start": 500}]},  # outside
        # 0 is nearer than 27
        {"question": "Q2", "context": context, "answers": [{"text": "Paris", "answer_start": 13}]},
    ]
    samples = load_qa(_write(tmp_path, "offsets.json", records))
    assert samples[0].answers == (("Paris", 27),) and samples[0].relocated == ((0, 22),)
    assert samples[1].answers == (("Rome", 14), ("Nice", 49)) and samples[1].relocated == ((1, 500),)
    assert samples[2].answers == (("Paris", 0),)
    for sample in samples:
        assert sample.problem is None
        for text, start in sample.answers:
            assert context[start:start + len(text)] == text


def test_an_answer_missing_from_the_context_refuses_its_sample_only(tmp_path):
    records = [
        {"question": "Q?", "context": "short", "answers": [{"text": "longer than it", "answer_start": 2}]},
        {"question": "Q?", "context": "a b c", "answers": [{"text": "b", "answer_start": 2}]},
    ]
    refused, kept = load_qa(_write(tmp_path, "broken.json", records))
    assert refused.problem == "answer 0 'longer than it' (answer_start 2) does not occur in the context"
    assert kept.problem is None and kept.relocated == ()


def test_stqa_350_paper_split():
    path = stqa_350()
    samples = load_qa(path, range=parse_range("250:350"))
    assert len(samples) == 100 and samples[0].index == 250
    assert all(s.answers for s in samples)
    for s in samples:
        for text, start in s.answers:
            assert s.context[start:start + len(text)] == text


def test_a_data_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text('{"question": "q", "context": "c", "answers": []}\n{"question": "r"}\n')
    with pytest.raises(ValueError, match=rf"{path}: not JSON \(Extra data: line 2"):
        load_qa(path)


def test_an_answer_without_its_offset_is_named(tmp_path):
    path = _write(tmp_path, "qa.json", [{"question": "Who?", "context": "Ann did.", "answers": [{"text": "Ann"}]}])
    with pytest.raises(ValueError, match="sample 0: answer 0 has no 'answer_start' field"):
        load_qa(path)
