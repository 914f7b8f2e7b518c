"""Evaluation of token attributions: QA data, context alignment, AUC-PR and faithfulness (MACS paper, Sec. 4)."""
