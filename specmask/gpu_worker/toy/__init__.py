"""Toy target/draft model pair: schemas, synthetic JSON corpus, tokenizer, training, cached build."""
