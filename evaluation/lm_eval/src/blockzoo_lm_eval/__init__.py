"""lm-evaluation-harness on blockzoo models: benchmark type `lm_eval` (`training.evaluation.harness`,
`blockzoo evaluate`)."""
