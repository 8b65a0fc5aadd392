"""One factory from a SourceConfig to rows: stored sources (deferred or opened), eager and streaming Hugging Face sources, text streams."""
