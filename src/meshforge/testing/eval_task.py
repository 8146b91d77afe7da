"""A local lm-eval multiple-choice task for the tests (nothing downloaded): its YAML, formatted with the path of a
jsonl file of {prompt, choices, label} rows. Shared by the eval tests and the launched workers of the in-training
eval test, which import it from the package (a test module is not importable there)."""

TASK_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
