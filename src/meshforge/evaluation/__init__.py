"""`meshforge eval`: perplexity on held-out files and downstream tasks through lm-eval-harness, on one process.

- `model.py`: the model and tokenizer of a run directory / checkpoint (its manifest's model, weights loaded as
  export reads them) or of a Hugging Face folder (config.json + safetensors + tokenizer);
- `perplexity.py`: the mean cross-entropy and perplexity over every sample of `data.*` (any source and format,
  the training data's tokenizer rules; a `data.mix` reports each source);
- `harness.py`: `MeshforgeLM`, lm-eval's model API (loglikelihood, loglikelihood_rolling, generate_until) over
  that model, and tasks from local files only (extra `eval`).
"""
