"""Evaluation of token attributions: QA data, context alignment, AUC-PR and faithfulness (MACS paper, Sec. 4).

data (QA samples, gold-answer offsets) -> alignment (context and answer tokens) -> record (one generation's
attention rows) -> methods + scoring (each method's scores, AUC-PR lines; metrics) and faithfulness (masking
curves) -> runner (the loop, content keys) writing store (the results stream, output paths) with
record_cache (recorded generations) -> report (the summary). The command line is macs_kernels.apps.cli.eval.
"""
