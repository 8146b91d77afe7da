"""Text generation: `meshforge generate` (cli.py) from a run's checkpoint or a Hugging Face folder (load.py), and the
decoding loop (decode.py: KV cache, left-padded batches, greedy / temperature / top-k / top-p with a seed) that
training's samples (`logging.samples`, training/samples.py) share."""
