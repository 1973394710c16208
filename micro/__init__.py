"""micro: the four-layer target model, its tokenizer, corpus, training and evaluation."""
